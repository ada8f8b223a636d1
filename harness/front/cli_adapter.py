"""The `adapter` command group of the CLI: `adapter verify DIR [DIR...] --model-config PATH [--layers N]`.

harness/front/cli.py registers it with `add_parser(sub)`; exit codes as the CLI's: 0 every line agrees, 1 a line fails,
2 a usage error (a missing file, a model this cannot build, transformers/peft missing).
"""
from __future__ import annotations

import argparse
import sys


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_parser(sub) -> None:
    """Add `adapter` (and its `verify`) to the CLI's subcommands `sub`."""
    a = sub.add_parser("adapter", help="PEFT adapter files of MoE experts: check the harness's reading against PEFT")
    asub = a.add_subparsers(dest="adapter_cmd", required=True)
    v = asub.add_parser("verify", help="read each adapter folder as the harness packs it and compare with PEFT's "
                                       "own float64 forward on the model's MoE blocks (random weights)")
    v.add_argument("dirs", nargs="+", metavar="DIR", help="PEFT adapter folders (adapter_config.json + "
                                                          "adapter_model.safetensors); each gets a slot")
    v.add_argument("--model-config", required=True, metavar="PATH",
                   help="the model's config.json (a file, or a folder holding one); no hub access")
    v.add_argument("--layers", type=_positive_int, default=1, metavar="N",
                   help="check the first N MoE layers the adapters adapt (default 1)")
    v.add_argument("--against", nargs="+", default=None, metavar="DIR",
                   help="PEFT's truth for each DIR, in order: the checkpoint a file was converted from (a layout "
                        "mistake in a file shows only against it); default: each DIR itself")
    v.add_argument("--tokens", type=_positive_int, default=16, metavar="T", help="tokens per forward (default 16)")
    v.add_argument("--seed", type=int, default=0, help="seed of the random base weights and hidden states")
    v.set_defaults(fn=cmd_verify)


def cmd_verify(args) -> int:
    """Print one line per checked tensor and forward, per layer; 0 when every line agrees."""
    import pathlib

    from moe_lora_harness.harness.served.models import ConfigError
    from moe_lora_harness.harness.served.peft_adapters import AdapterFileError
    missing = [d for d in args.dirs + (args.against or []) if not pathlib.Path(d).is_dir()]
    if missing:
        print(f"moe-lora-harness adapter verify: error: {missing[0]!r} is not a folder (an adapter folder holds "
              "adapter_config.json and adapter_model.safetensors)", file=sys.stderr)
        return 2
    try:
        from moe_lora_harness.harness.served.adapter_verify import verify
        report = verify(args.dirs, args.model_config, layers=args.layers, against=args.against, tokens=args.tokens,
                        seed=args.seed)
    except (ImportError, ConfigError, AdapterFileError, ValueError) as e:
        print(f"moe-lora-harness adapter verify: error: {e}", file=sys.stderr)
        return 2
    print(report.text())
    bad = sum(1 for x in report.lines if getattr(x, "ok", True) is False)
    print(f"{'PASS' if report.ok else 'FAIL'}: {bad} line(s) disagree" if bad else "PASS: every line agrees with "
          "PEFT within float64 rounding (bound: docs/adapters.md)"
          + ("" if args.against else "; the files' own layout unchecked (no --against)"))
    return 0 if report.ok else 1
