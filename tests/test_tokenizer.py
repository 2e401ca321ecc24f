"""CharTokenizer, its HF twin written by `save`, and `load_tokenizer`."""

import pytest
import transformers

from jmarl.errors import JmarlError
from jmarl.models import CharTokenizer, load_tokenizer

TEXTS = ["Hello, world!", "line one\nline two\n", "  spaced  ~{}|", "x = 3 * (4 + 5)", "caf\u00e9 \u2603"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?\nAnswer:"}]


def test_char_tokenizer_layout_and_round_trip():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (0, 1, 2, 99)
    assert tok.encode(" ") == [3] and tok.encode("~") == [97] and tok.encode("\n") == [98]
    for text in TEXTS[:4]:
        ids = tok.encode(text)
        assert len(ids) == len(text) and min(ids) >= 3
        assert tok.decode(ids) == text
    assert tok.decode(tok.encode("caf\u00e9")) == "caf?"  # non-ASCII maps to '?'
    assert tok.decode([2, 43, 1, 0]) == "H"
    assert tok.decode([2, 43, 1], skip_special_tokens=False) == "<s>H</s>"
    with pytest.raises(JmarlError, match="outside"):
        tok.decode([99])
    chat = tok.apply_chat_template(MESSAGES)
    assert chat == "system: Be brief.\nuser: 2+2?\nAnswer:\nassistant: "
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True) == tok.encode(
        "system: Be brief.\nuser: 2+2?\nAnswer:\n"
    )


def test_saved_char_tokenizer_is_the_same_in_transformers(tmp_path):
    tok = CharTokenizer()
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id, len(hf)) == (0, 1, 2, 99)
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf(text)["input_ids"] == ids  # no special tokens added by default either
        assert hf.decode(ids) == tok.decode(ids)
    assert hf.decode([2, 40, 41, 1, 0], skip_special_tokens=True) == tok.decode([2, 40, 41, 1, 0])
    for gen in (True, False):
        assert hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False) == (
            tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        )
    ours = load_tokenizer(tmp_path)
    assert (ours.pad_id, ours.eos_id, ours.bos_id, ours.vocab_size) == (0, 1, 2, 99)
    for text in TEXTS:
        assert ours.encode(text) == tok.encode(text)
        assert ours.decode(ours.encode(text)) == tok.decode(tok.encode(text))
    assert ours.apply_chat_template(MESSAGES, tokenize=True) == tok.apply_chat_template(MESSAGES, tokenize=True)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(JmarlError, match="not found"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(JmarlError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_char_tokenizer_beside_a_qwen_model_loads_as_itself(tmp_path):
    """An exported policy directory (config.json of a qwen2 model + the saved CharTokenizer)
    loads the same tokenizer, not the class config.json's model_type would pick."""
    import jax

    from _tiny_models import tiny_qwen3
    from jmarl import models

    tok = models.CharTokenizer()
    cfg = tiny_qwen3(model_type="qwen2", vocab_size=tok.vocab_size, qk_norm=False, o_bias=False)
    models.save_hf(tmp_path, cfg, models.init(cfg, jax.random.key(0)))
    tok.save(tmp_path)
    loaded = models.load_tokenizer(tmp_path)
    text = "user: a b c\nassistant: R R D\n"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(tok.encode(text)) == text


def _gemma_like_tokenizer(tmp_path):
    """The repo's byte-level BPE tokenizer with Gemma's turn and <bos> tokens added."""
    from jmarl.models.tokenizer import HFTokenizer

    hf = load_tokenizer("configs/hacpo/tokenizers/byte_bpe").hf
    hf.add_special_tokens({"bos_token": "<bos>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    return HFTokenizer(hf)


def test_gemma_chat_template_renders_turns_and_ends_replies_at_end_of_turn(tmp_path):
    """model.chat_template: gemma on a tokenizer without Gemma's template: the hand-written turn
    text (the system message joins the first user turn), and <end_of_turn> stops a reply."""
    from jmarl.config import SamplingConfig
    from jmarl.models.tokenizer import use_chat_template
    from jmarl.train.sampling import stop_tokens

    tok = use_chat_template(_gemma_like_tokenizer(tmp_path), "gemma")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is 3 + 4? "},
                {"role": "assistant", "content": "7"}, {"role": "user", "content": "And 2 + 2?"}]
    assert tok.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 3 + 4?<end_of_turn>\n<start_of_turn>model\n7<end_of_turn>\n"
        "<start_of_turn>user\nAnd 2 + 2?<end_of_turn>\n<start_of_turn>model\n")
    end = tok.hf.convert_tokens_to_ids("<end_of_turn>")
    assert tok.stop_ids == (tok.eos_id, end)
    assert stop_tokens(SamplingConfig(), tok) == (tok.eos_id, end)
    assert stop_tokens(SamplingConfig(ignore_eos=True), tok) == ()


def test_chat_template_as_jinja_text_and_refusals(tmp_path):
    from jmarl.models.tokenizer import use_chat_template

    tok = use_chat_template(load_tokenizer("configs/hacpo/tokenizers/byte_bpe"), "Q: {{ messages[0]['content'] }}\nA:")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "Q: hi\nA:"
    assert tok.stop_ids == (tok.eos_id,)
    with pytest.raises(JmarlError, match="'<end_of_turn>', which this tokenizer does not have"):
        use_chat_template(load_tokenizer("configs/hacpo/tokenizers/byte_bpe"), "gemma")
    with pytest.raises(JmarlError, match="CharTokenizer has a fixed prompt format"):
        use_chat_template(CharTokenizer(), "gemma")
