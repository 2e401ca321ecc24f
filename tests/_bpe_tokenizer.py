"""A tiny byte-level BPE tokenizer (HF format) with its own vocabulary and chat template.

Used where a test (or `configs/hacpo/math_tiny.yaml`, whose copy lives in
`configs/hacpo/tokenizers/byte_bpe`) needs a second tokenizer that differs from the
CharTokenizer in vocabulary, ids, special tokens and template. Byte-level, so
`decode(encode(text)) == text` for any text without its special tokens.

    python tests/_bpe_tokenizer.py configs/hacpo/tokenizers/byte_bpe
"""

from __future__ import annotations

import sys
from pathlib import Path

SENTENCES = [
    "Problem: What is 3 + 4? Solve it step by step and put the final answer in \\boxed{...}.",
    "The answer is \\boxed{7}. The answer is \\boxed{2}. The answer is \\boxed{9}.",
    "Mateo earns 9 dollars per hour and works 5 hours a day for 5 days.",
    "How many apples are left after she gives away two of them?",
    "Compute the sum, then subtract, then multiply the result by two.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } [ ] \\boxed",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_byte_bpe(directory: str | Path, vocab_size: int = 384) -> Path:
    """Trains the tokenizer on `SENTENCES` and saves it (tokenizer.json + config) in `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|user|>", "<|assistant|>"], clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


if __name__ == "__main__":
    print(build_byte_bpe(sys.argv[1]))
