"""Chat data for the extraction, regeneration and online-training tests: the testbed's real tokenizer, a tiny
Llama over its vocabulary, generated chat records and files, and regeneration's greedy reference."""

import functools
import json

import torch
import transformers as tf

from .tiny_targets import hf_model


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The testbed's tokenizer (ChatML template), from the cached conversion of the packaged GGUF."""
    from dflashkit.targets.loading import resolve_target_dir

    model_dir, _ = resolve_target_dir("testbed:smollm2")
    return tf.AutoTokenizer.from_pretrained(model_dir)


def save_tiny_chat_target(out_dir, seed=0, initializer_range=0.02):
    """A 4-layer Llama (hidden 32) over the full SmolLM2 vocabulary, saved with the testbed tokenizer."""
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                            tie_word_embeddings=True, initializer_range=initializer_range)
    tf.LlamaForCausalLM(config).save_pretrained(out_dir)
    smollm2_tokenizer().save_pretrained(out_dir)
    return str(out_dir)


def chat_records(n, seed=0):
    """Conversations of varied length (1-3 exchanges, 1-40 words a turn)."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "kilo", "lima", "mike"]

    def text():
        n_words = int(torch.randint(1, 40, (1,), generator=g))
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n_words,), generator=g))

    out = []
    for _ in range(n):
        msgs = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path, records, bad_lines=()):
    """records as JSON lines; bad_lines: {line number (1-based): raw text} inserted as they are."""
    lines, it = [], iter(records)
    total = len(records) + len(bad_lines)
    for k in range(1, total + 1):
        lines.append(dict(bad_lines)[k] if k in dict(bad_lines) else json.dumps(next(it)))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def load_records(specs, split=None, limit=None) -> list:
    """The first ``limit`` records of data specs (all when None) as a list."""
    from dflashkit.extract.data.sources import iter_records

    out = []
    for item in iter_records(specs, split):
        if limit is not None and len(out) >= limit:
            break
        out.append(item)
    return out


# ----------------------------------------------------------------------------- regeneration
# one record of each input format regenerate reads, and one without a user turn (skipped)
REGENERATE_RECORDS = [
    {"conversations": [{"from": "human", "value": "alpha beta"}, {"from": "gpt", "value": "old answer"},
                       {"from": "human", "value": "gamma"}, {"from": "gpt", "value": "old again"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "delta echo fox"}]},
    {"prompt": "golf", "response": "old"},
    {"text": "no conversation here"},
    {"messages": [{"role": "user", "content": "hotel india kilo lima mike"}]},
]


def greedy_reference(target_dir, messages, max_new):
    """Argmax decoding of one conversation alone, no generate(), stopping at <|im_end|>."""
    tok, model = smollm2_tokenizer(), hf_model(target_dir)
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    new = []
    with torch.no_grad():
        for _ in range(max_new):
            t = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if t in stop:
                break
            new.append(t)
    return tok.decode(new, skip_special_tokens=True)
