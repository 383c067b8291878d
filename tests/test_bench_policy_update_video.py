"""bench/policy_update_video.py's switch between the vision tower's per-window and grouped attention, on CPU."""

from __future__ import annotations

from setups import load_bench


def test_switch_finds_the_vision_attention_and_flips_it_between_native_and_grouped(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    from physreason.models.vision_attention import registered_name, use_grouped_vision_attention

    bench = load_bench("policy_update_video")
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    assert use_grouped_vision_attention(model)
    switch = bench.VisionAttentionSwitch(model)  # failed with an ImportError once physreason renamed the class list
    assert (switch.native, switch.grouped) == ("sdpa", registered_name("sdpa"))
    switch.set(grouped=False)
    assert {c._attn_implementation for c in switch.configs} == {"sdpa"}
    switch.set(grouped=True)
    assert {c._attn_implementation for c in switch.configs} == {registered_name("sdpa")}
