"""`serve run kvharbor.app` builds the app in a process that never runs the model, and a
gateway replica only tokenizes and hashes: importing the app's and the gateway's modules, and
what a gateway computes at start (tokenizer, context length, model identity), do not import
torch (seconds of CPU before Ray even starts, then on the cores the LLM replicas load on)."""

from __future__ import annotations

import subprocess
import sys

from kvharbor.engine.model_info import BUILTIN_CONTEXT, BUILTIN_NAMES, load_tokenizer, model_context_length
from kvharbor.engine.models import BUILTIN_MODELS, byte_tokenizer


def test_building_the_app_and_starting_a_gateway_leave_torch_unloaded():
    code = ("import sys\n"
            "import kvharbor.platform.app, kvharbor.platform.gateway\n"
            "from kvharbor.engine.model_identity import model_identity\n"
            "from kvharbor.engine.model_info import load_tokenizer, model_context_length\n"
            "assert load_tokenizer('kvharbor/tiny-llama').encode('hi')\n"
            "assert model_context_length('kvharbor/tiny-llama') and model_identity('kvharbor/tiny-llama')\n"
            "print(sorted(m for m in ('torch', 'transformers.modeling_utils') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_the_gateways_model_facts_are_the_engines():
    assert set(BUILTIN_NAMES) == set(BUILTIN_MODELS)
    for name, config in BUILTIN_MODELS.items():
        assert model_context_length(name) == config.max_position_embeddings == BUILTIN_CONTEXT
        assert load_tokenizer(name).get_vocab() == byte_tokenizer().get_vocab()


def test_the_app_counts_the_gpus_ray_places_replicas_on(monkeypatch):
    """Replicas ask Ray for ``num_gpus=1``: GPUs on other nodes of the cluster count, and GPUs
    Ray was told not to use do not."""
    import ray

    from kvharbor.platform import app

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 4.0})
    assert app._gpus() == 4
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert app._gpus() == 0
