"""Loading models from several threads at once (the teacher prefetcher loads while the trainer does)."""
import threading

import torch

from opd_sao.checkpoints import load_causal_lm
from opd_sao.trainers.critic import ValueModel


def test_concurrent_loads_leave_no_patched_global_state(tiny_model_dir):
    reference = load_causal_lm(tiny_model_dir).state_dict()
    init_normal, default_dtype = torch.nn.init.normal_, torch.get_default_dtype()
    errors: list[BaseException] = []
    loaded: list[torch.nn.Module] = []

    def load_many(kind):
        try:
            for _ in range(6):
                loaded.append(ValueModel.from_pretrained(tiny_model_dir) if kind else load_causal_lm(tiny_model_dir))
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=load_many, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert torch.nn.init.normal_ is init_normal and torch.get_default_dtype() == default_dtype
    assert torch.empty(1).device.type == "cpu"
    for model in loaded:
        for name, value in model.state_dict().items():
            assert value.device.type == "cpu", name
            if name in reference:
                torch.testing.assert_close(value, reference[name], rtol=0, atol=0)
            elif name.startswith("value_head"):
                assert torch.count_nonzero(value) == 0, name
    fresh = load_causal_lm(tiny_model_dir).state_dict()
    for name, value in reference.items():
        torch.testing.assert_close(fresh[name], value, rtol=0, atol=0)
