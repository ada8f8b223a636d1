"""`moe-lora-harness adapter verify` as a user runs it: exit 0 and PASS on a good file, 1 with the tensor and the
layout named on a mis-laid-out one, 2 on a usage error; transformers run with the checkout's root off sys.path."""
from __future__ import annotations

import re
import sys

import pytest

from moe_lora_harness.harness.front.cli import main
from moe_lora_harness.harness.served.hf_moe_block import _ROOT, hf_session

from . import tiny_models as tm

KEY = "base_model.model.model.layers.0.mixer.experts.lora_B.weight"      # Nemotron-H's down_proj B


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    good = tm.peft_adapter("nemotron_h", d / "good", ("up_proj", "down_proj"), r=4, lora_alpha=8)[0]
    r, E = 4, tm.E
    bad = tm.rewrite(good, d / "bad",
                     lambda t: {**t, KEY: t[KEY].reshape(-1, r, E).permute(0, 2, 1).reshape(-1, r * E)})
    return good, bad, tm.write_config("nemotron_h", d / "model")


def test_verify_exit_codes_and_lines(files, capsys):
    good, bad, config = files
    assert main(["adapter", "verify", str(good), "--model-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "PASS: every line agrees" in out and "ok    [0] up_proj delta weight" in out
    assert "without --against" in out and "own layout unchecked (no --against)" in out   # it cannot tell: said
    assert main(["adapter", "verify", str(bad), "--model-config", str(config), "--against", str(good)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  [0] down_proj delta weight" in out and KEY in out and "'b-expert-major'" in out
    assert out.rstrip().endswith("line(s) disagree") and "without --against" not in out


def test_usage_errors(files, capsys, tmp_path):
    good, _, config = files
    assert main(["adapter", "verify", str(tmp_path / "nowhere"), "--model-config", str(config)]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["adapter", "verify", str(good)]) == 2
    assert "--model-config" in capsys.readouterr().err
    assert main(["adapter", "verify", str(good), "--model-config", str(tmp_path / "none.json")]) == 2
    assert "neither a config.json file nor a folder" in capsys.readouterr().err
    assert main(["adapter", "verify", str(good), "--model-config", str(config), "--against", str(good),
                 str(good)]) == 2
    assert "one folder per adapter" in capsys.readouterr().err


def test_hf_session_hides_the_checkout_root_and_restores_it():
    """From the repository root (`python -m`, `python -c`), its `kernels/` folder would shadow the hub package
    transformers probes for; inside the session the root is off sys.path, afterwards back in place."""
    before = list(sys.path)
    sys.path.insert(0, str(_ROOT))
    try:
        with hf_session():
            assert str(_ROOT) not in sys.path
        assert sys.path[0] == str(_ROOT)
    finally:
        sys.path[:] = before


def test_missing_hf_packages_name_the_extra(monkeypatch):
    """Without peft (or transformers) the command says which extra installs them."""
    from moe_lora_harness.harness.served.hf_moe_block import hf
    monkeypatch.setitem(sys.modules, "peft", None)         # `import peft` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'moe-lora-harness\[hf\]'"):
        hf()


def test_adapter_verify_names_the_config_file_in_its_errors(tmp_path):
    from moe_lora_harness.harness.served.hf_moe_block import model_config
    from moe_lora_harness.harness.served.models import ConfigError
    f = tmp_path / "config.json"
    f.write_text('{"model_type": "qwen3_moe", "hidden_size": 32}')
    with pytest.raises(ConfigError, match=re.escape(f"model config '{f}': missing key 'moe_intermediate_size'")):
        model_config(f)

