"""Transformers backend: load the verifier in-process and capture the states EAGLE-3 needs with forward hooks.

Which states (vLLM's convention, see docs/DESIGN.md):
* aux id k = the residual stream ENTERING decoder layer k = the first argument of ``layers[k].forward``
  (= HF ``output_hidden_states[k]``; id 0 = the embedding output);
* final = the output of the LAST decoder layer BEFORE the final norm = the argument of ``norm.forward``
  (HF ``output_hidden_states[-1]`` is already normed, so it is not used).
Hooks keep only these tensors alive, instead of all L+1 states ``output_hidden_states`` would hold. The forward runs
the decoder stack only (no ``lm_head``: a [tokens, 163840] logits matrix for Kimi would be pure waste).

Nested checkpoints (Kimi-K2.5: DeepseekV3 weights under ``language_model.``, config in ``text_config``) are
built from the text config and loaded with the prefix stripped, without ``trust_remote_code``.
"""

from __future__ import annotations

import logging
import time

import torch

from eagle3.support.verifier import VerifierError, VerifierSpec, find_tensor_names

log = logging.getLogger("eagle3.extract")


def _prefix(spec: VerifierSpec) -> str:
    """Weight-name prefix in front of the HF names (``language_model.`` for Kimi-K2.5; '' for flat checkpoints)."""
    names = find_tensor_names(spec.path)
    emb = names["embed_tokens"]
    if emb is None:
        raise VerifierError(f"embed_tokens.weight not found in {spec.path}")
    tail = "model.embed_tokens.weight"
    return emb[: -len(tail)] if emb.endswith(tail) else ""


def load_hf_model(
    spec: VerifierSpec,
    dtype: torch.dtype,
    device: str,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The verifier as a transformers causal LM in eval mode (weights memory-mapped from safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars do not survive in logs
    kwargs: dict = {"dtype": dtype, "trust_remote_code": trust_remote_code, "use_safetensors": True}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if spec.nested:
        cfg = AutoConfig.for_model(**spec.transformers_text_config())
        prefix = _prefix(spec)
        kwargs["config"] = cfg
        if prefix:
            kwargs["key_mapping"] = {"^" + prefix.replace(".", r"\."): ""}
    t0 = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(spec.path), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise VerifierError(f"cannot load verifier {spec.path} with transformers: {e}") from e
    if device_map is None:
        model.to(device)
    model.eval().requires_grad_(False)
    log.info("loaded verifier %s (%s, %s) in %.1f s", spec.path, type(model).__name__, dtype, time.monotonic() - t0)
    return model


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.Module]:
    """(decoder stack module, its layers, its final norm) of a causal LM."""
    decoder = getattr(model, "model", None) or model.get_decoder()
    layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if layers is None or norm is None:
        raise VerifierError(f"{type(model).__name__}: cannot find decoder .layers and final .norm")
    return decoder, layers, norm


class TransformersBackend:
    """Captures aux + final states for a right-padded batch. ``aux_layer_ids`` in vLLM's convention."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: list[int]):
        self.model = model
        self.decoder, self.layers, self.norm = decoder_parts(model)
        if max(aux_layer_ids) >= len(self.layers):
            raise VerifierError(f"aux_layer_ids {aux_layer_ids} out of range for {len(self.layers)} decoder layers")
        self.aux_layer_ids = list(aux_layer_ids)
        self.input_device = model.get_input_embeddings().weight.device
        self._captured: dict[str, torch.Tensor] = {}

    def _hooks(self) -> list:
        def aux_hook(k: int):
            def hook(_module, args, kwargs):
                self._captured[f"aux{k}"] = args[0] if args else kwargs["hidden_states"]  # [B, T, H]

            return hook

        def final_hook(_module, args):
            self._captured["final"] = args[0]  # [B, T, H], last decoder layer output, before the norm

        hs = [self.layers[k].register_forward_pre_hook(aux_hook(k), with_kwargs=True) for k in self.aux_layer_ids]
        hs.append(self.norm.register_forward_pre_hook(final_hook))
        return hs

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask: [B, T] -> (aux [B, T, n_aux * H] in aux_layer_ids order, final [B, T, H]),
        compute dtype, on the device of the last layer."""
        handles = self._hooks()
        try:
            self.decoder(input_ids=input_ids.to(self.input_device),
                         attention_mask=attention_mask.to(self.input_device), use_cache=False)
            final = self._captured["final"]
            aux = torch.cat([self._captured[f"aux{k}"].to(final.device) for k in self.aux_layer_ids], dim=-1)
            return aux, final
        finally:
            for h in handles:
                h.remove()
            self._captured.clear()

    @torch.inference_mode()
    def bare_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """The same decoder forward with nothing captured or written (the benchmark's baseline)."""
        self.decoder(input_ids=input_ids.to(self.input_device),
                     attention_mask=attention_mask.to(self.input_device), use_cache=False)
