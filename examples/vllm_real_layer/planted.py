"""Bugs planted into vLLM's layer functions at run time (no vLLM file changed): does the harness catch each through the
real layer? One BackendSpec per bug, each the padded wrapper with one of vLLM's functions replaced on its instance:

    reset-keeps-weights     FusedMoEWithLoRA.reset_lora only clears adapter_enabled (the slot's factors stay)
    set-lora-no-reset       FusedMoEWithLoRA.set_lora copies without its reset_lora (a smaller rank keeps the rest)
    minus-one-keeps-slot    tokens mapped to -1 keep the slot the previous batch gave that position
    metadata-cached         update_metadata skipped when the batch has as many tokens as the last one

    TRITON_INTERPRET=1 python -m moe_lora_harness check --device cpu \
        --backend examples/vllm_real_layer/planted.py:PLANTED --only planted-reset-keeps-weights
Each must FAIL some row; the unplanted layer passes all.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_real_layer as vrl  # noqa: E402


def _reset_keeps_weights(layer):
    def reset_lora(self, index):
        self.adapter_enabled[index] = 0            # the factors are not zeroed
    layer.layer.reset_lora = types.MethodType(reset_lora, layer.layer)


def _set_lora_no_reset(layer):
    real_reset = layer.layer.reset_lora
    cls_set = type(layer.layer).set_lora

    def set_lora(self, index, lora_a, lora_b):
        self.reset_lora = lambda i: self.adapter_enabled.__setitem__(i, 0)   # set_lora's own reset does nothing
        try:
            cls_set(self, index, lora_a, lora_b)
        finally:
            self.reset_lora = real_reset
    layer.layer.set_lora = types.MethodType(set_lora, layer.layer)


def _minus_one_keeps_slot(layer):
    set_mapping = layer.set_mapping
    prev = {}

    def patched(mapping):
        m = mapping.clone()
        for i, s in enumerate(m.tolist()):
            if s < 0 and i in prev and layer.lora_index_to_id[prev[i]] is not None:
                m[i] = prev[i]
        for i, s in enumerate(m.tolist()):
            if s >= 0:
                prev[i] = s
        set_mapping(m)
    layer.set_mapping = patched


def _metadata_cached(layer):
    set_mapping = layer.set_mapping
    last = [None]

    def patched(mapping):
        if last[0] == mapping.numel():
            return
        last[0] = mapping.numel()
        set_mapping(mapping)
    layer.set_mapping = patched


BUGS = {"reset-keeps-weights": _reset_keeps_weights, "set-lora-no-reset": _set_lora_no_reset,
        "minus-one-keeps-slot": _minus_one_keeps_slot, "metadata-cached": _metadata_cached}


def _factory(plant):
    def make(config, weights):
        layer = vrl.VllmRealLayerPadded(config, weights)
        if config.lora_enabled:
            plant(layer)
        return layer
    return make


PLANTED = [dataclasses.replace(vrl.VLLM_REAL_LAYER_PADDED, name=f"planted-{name}", layer=_factory(fn),
                               description=f"vllm_real_layer_padded with a planted bug: {name}")
           for name, fn in BUGS.items()]
