"""Names that moved in the house plan still import from their old paths for one release, each
with a DeprecationWarning that names the new place."""
import importlib
import sys

import pytest


@pytest.mark.parametrize("module,name,new", [
    ("forge_ml.models.gpt2", "DecodeStep", "forge_ml.inference.decode"),
    ("forge_ml.models.gpt2", "KVCache", "forge_ml.inference.decode"),
    ("forge_ml.models", "KVCache", "forge_ml.inference"),
    ("forge_ml.train", "load_model", "forge_ml.inference.load"),
    ("forge_ml.train", "resolve_checkpoint", "forge_ml.inference.load"),
])
def test_old_attribute_paths(module, name, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=new):
        obj = getattr(mod, name)
    assert obj is getattr(importlib.import_module(new.replace("forge_ml.inference", "forge_ml.inference")), name)


def test_old_generate_module():
    sys.modules.pop("forge_ml.generate", None)
    with pytest.warns(DeprecationWarning, match="forge_ml.inference.generate"):
        old = importlib.import_module("forge_ml.generate")
    from forge_ml.inference import generate
    assert old.generate is generate


def test_params_keyword_is_refused_with_the_way_forward():
    from forge_ml import tensor
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    m = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
    with pytest.raises(TypeError, match="dtype='bfloat16'"):
        m.loss_and_grads(tensor([[1, 2]]), tensor([[2, 3]]), params=m.params)
