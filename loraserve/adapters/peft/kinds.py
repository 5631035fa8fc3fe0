"""PEFT's adapter kinds (`peft_type` in adapter_config.json) and the one we serve. Every other
kind is refused in one line naming it: serving it as LoRA, or ignoring it, would answer with
the wrong weights."""

from __future__ import annotations

SERVED = "LORA"
# peft_type -> what its users call it (PEFT's PeftType values)
KNOWN = {
    "PROMPT_TUNING": "prompt tuning", "MULTITASK_PROMPT_TUNING": "multitask prompt tuning",
    "P_TUNING": "P-tuning", "PREFIX_TUNING": "prefix tuning", "LORA": "LoRA",
    "ADALORA": "AdaLoRA", "ADAMSS": "AdaMSS", "BOFT": "BOFT",
    "ADAPTION_PROMPT": "adaption prompt (LLaMA-Adapter)", "IA3": "IA3", "BEFT": "BEFT",
    "LILY": "LiLY", "LOHA": "LoHa", "LOKR": "LoKr", "OFT": "OFT", "POLY": "Poly",
    "LN_TUNING": "LayerNorm tuning", "VERA": "VeRA", "FROD": "FRoD", "PVERA": "PVeRA",
    "FOURIERFT": "FourierFT", "GLORA": "GLoRA", "XLORA": "X-LoRA", "HRA": "HRA",
    "VBLORA": "VB-LoRA", "UNILORA": "UniLoRA", "CPT": "CPT", "MISS": "MiSS",
    "RANDLORA": "RandLoRA", "ROAD": "RoAd", "TRAINABLE_TOKENS": "trainable tokens alone",
    "HIRA": "HiRA", "SHIRA": "SHiRA", "C3A": "C3A", "WAVEFT": "WaveFT", "OSF": "OSF",
    "DELORA": "DeLoRA", "GRALORA": "GraLoRA", "CARTRIDGE": "Cartridge",
    "TINYLORA": "TinyLoRA", "PSOFT": "PSOFT", "PEANUT": "PEANUT", "SHADOW": "Shadow",
    "SUPERTUNING": "SuperTuning", "DEFT": "DEFT",
}


def refusal(peft_type: object) -> str | None:
    """Why an adapter of this peft_type is refused (None: it is served)."""
    if isinstance(peft_type, str) and peft_type.upper() == SERVED:
        return None
    kind = KNOWN.get(peft_type.upper()) if isinstance(peft_type, str) else None
    if kind is None:
        return f"peft_type {peft_type!r} is not a PEFT adapter kind we know; only LORA is served"
    return (f"peft_type {peft_type} ({kind}) is not supported; only LORA adapters (with DoRA, "
            f"lora_bias, rsLoRA, embedding/lm_head targets, modules_to_save, trainable tokens)"
            f" are served")
