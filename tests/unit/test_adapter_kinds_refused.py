"""Every PEFT adapter kind we do not serve is refused in one line naming it: each adapter
here is saved by PEFT itself (its own config and weights) from a tiny Llama."""

from __future__ import annotations

import pytest
from adapter_factory import load_base_model

from loraserve.adapters.format import read_adapter, read_adapter_config
from loraserve.adapters.peft.kinds import KNOWN
from loraserve.config import ModelConfig
from loraserve.types import AdapterFormatError

T = ["q_proj", "v_proj"]


def _configs():
    import peft

    return {
        "VERA": lambda: peft.VeraConfig(r=4, target_modules=T),
        "LOHA": lambda: peft.LoHaConfig(r=4, target_modules=T),
        "LOKR": lambda: peft.LoKrConfig(r=4, target_modules=T),
        "IA3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                      feedforward_modules=["down_proj"]),
        "ADALORA": lambda: peft.AdaLoraConfig(r=4, target_modules=T, total_step=10),
        "OFT": lambda: peft.OFTConfig(r=0, oft_block_size=16, target_modules=T),
        "BOFT": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=T),
        "PROMPT_TUNING": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                         num_virtual_tokens=4),
        "PREFIX_TUNING": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                         num_virtual_tokens=4),
        "P_TUNING": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4,
                                                     encoder_hidden_size=16),
        "FOURIERFT": lambda: peft.FourierFTConfig(n_frequency=16, target_modules=T),
        "HRA": lambda: peft.HRAConfig(r=4, target_modules=T),
        "VBLORA": lambda: peft.VBLoRAConfig(r=4, target_modules=T, vector_length=16,
                                            num_vectors=8),
        "LN_TUNING": lambda: peft.LNTuningConfig(target_modules=["input_layernorm"]),
        "TRAINABLE_TOKENS": lambda: peft.TrainableTokensConfig(token_indices=[3, 4],
                                                               target_modules=["embed_tokens"]),
        "MISS": lambda: peft.MissConfig(r=4, target_modules=T),
        "RANDLORA": lambda: peft.RandLoraConfig(r=4, target_modules=T),
        "C3A": lambda: peft.C3AConfig(block_size=16, target_modules=T),
        "SHIRA": lambda: peft.ShiraConfig(r=4, target_modules=T),
        "DELORA": lambda: peft.DeloraConfig(r=4, target_modules=T),
        "WAVEFT": lambda: peft.WaveFTConfig(n_frequency=16, target_modules=T),
    }


KINDS = ["VERA", "LOHA", "LOKR", "IA3", "ADALORA", "OFT", "BOFT", "PROMPT_TUNING",
         "PREFIX_TUNING", "P_TUNING", "FOURIERFT", "HRA", "VBLORA", "LN_TUNING",
         "TRAINABLE_TOKENS", "MISS", "RANDLORA", "C3A", "SHIRA", "DELORA", "WAVEFT"]


@pytest.mark.parametrize("kind", KINDS)
def test_peft_made_adapter_of_another_kind_is_refused_naming_it(kind, tiny_model_dir,
                                                                 tmp_path):
    import peft

    model = peft.get_peft_model(load_base_model(tiny_model_dir), _configs()[kind]())
    assert model.peft_config["default"].peft_type.value == kind
    model.save_pretrained(tmp_path)
    mc = ModelConfig.from_dir(tiny_model_dir)
    for read in (lambda: read_adapter_config(tmp_path, mc),
                 lambda: read_adapter(tmp_path, mc, max_lora_rank=64)):
        with pytest.raises(AdapterFormatError) as e:
            read()
        msg = str(e.value)
        assert f"peft_type {kind} ({KNOWN[kind]}) is not supported" in msg, msg
        assert "\n" not in msg


def test_every_peft_type_has_a_name_and_unknown_ones_are_refused(tmp_path):
    import json

    from peft.utils.peft_types import PeftType

    assert {t.value for t in PeftType} <= set(KNOWN)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "NEWTHING"}))
    with pytest.raises(AdapterFormatError, match="'NEWTHING' is not a PEFT adapter kind"):
        read_adapter_config(tmp_path)


def test_engine_load_of_a_vera_adapter_is_refused_and_changes_nothing(tiny_model_dir,
                                                                      tmp_path):
    import peft

    from loraserve import LLM
    from loraserve.types import LoraServeError

    model = peft.get_peft_model(load_base_model(tiny_model_dir), _configs()["VERA"]())
    model.save_pretrained(tmp_path)
    llm = LLM(str(tiny_model_dir))
    with pytest.raises(LoraServeError, match=r"VeRA"):
        llm.load_lora_adapter("v", str(tmp_path))
    assert llm.engine.store.num_registered == 0
