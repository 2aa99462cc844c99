"""GGUF files with SentencePiece ("llama") tokenizers, as Llama 2, Mistral, Gemma and Phi-3 files
carry them: a BPE SentencePiece model trained here on Python's own documentation, written as
convert_hf_to_gguf.py writes one (pieces, scores, token types, add_space_prefix). Our tokenizer
must encode as SentencePiece itself does, and a model file with it must serve through
`tessera serve` with the same greedy tokens as transformers on the same weights."""
from __future__ import annotations

import io
import random
from pathlib import Path

import gguf
import openai
import pytest
import torch
from pydoc_data.topics import topics
from transformers import LlamaConfig, LlamaForCausalLM

from servers import tessera_serve
from tessera.config import ConfigError
from tessera.models.gguf_tokenizer import gguf_tokenizer
from test_gguf_families import convert

spm = pytest.importorskip("sentencepiece")

TEXT = list(topics.values())
SPECIAL = "<tool_call>"    # a user-defined piece, as chat models add them


def train(add_dummy_prefix: bool, vocab_size: int):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter("\n".join(TEXT).splitlines()[:3000]), model_writer=model,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, add_dummy_prefix=add_dummy_prefix,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, user_defined_symbols=[SPECIAL], split_digits=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_tokenizer(w: gguf.GGUFWriter, sp, add_space_prefix: bool) -> None:
    """convert_hf_to_gguf.py's _set_vocab_sentencepiece."""
    types = []
    for i in range(sp.vocab_size()):
        kind = gguf.TokenType.NORMAL
        for test, k in ((sp.is_unknown, gguf.TokenType.UNKNOWN), (sp.is_control, gguf.TokenType.CONTROL),
                        (sp.is_unused, gguf.TokenType.UNUSED), (sp.is_byte, gguf.TokenType.BYTE)):
            if test(i):
                kind = k
        types.append(gguf.TokenType.USER_DEFINED if sp.id_to_piece(i) == SPECIAL else kind)
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.vocab_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.vocab_size())])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(add_space_prefix)


def tokenizer_only(path: Path, sp, add_space_prefix: bool) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    write_tokenizer(w, sp, add_space_prefix)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    return path


def samples(n: int) -> list[str]:
    rng = random.Random(0)
    out = ["Hello world", "  two  spaces\nnew line\ttab", "naïve café — 東京 😀 ∮", "x = f(123456) + 7.5",
           "def __init__(self):\n    return None"]
    for _ in range(n):
        t = rng.choice(TEXT)
        start = rng.randrange(len(t))
        out.append(t[start:start + rng.randrange(1, 400)])
    return out


# Llama 2 / Mistral / Phi-3 prepend a space to the text; Gemma does not
@pytest.mark.parametrize("prefix", [True, False], ids=["space-prefix", "no-prefix"])
def test_encodes_as_sentencepiece_does(tmp_path, prefix):
    sp = train(prefix, 3000)
    tok = gguf_tokenizer(tokenizer_only(tmp_path / "t.gguf", sp, prefix))
    for text in samples(200):
        ids = tok.encode(text)
        assert ids == [1] + sp.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:]), text
    # a user-defined piece is one token; the text after it starts a new word, as in llama.cpp
    assert tok.encode(f"call {SPECIAL}x") == [1] + sp.encode("call ") + [sp.piece_to_id(SPECIAL)] + sp.encode("x")


def test_an_unknown_tokenizer_model_is_a_config_error_naming_it(tmp_path):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a"])
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    with pytest.raises(ConfigError, match="GGUF tokenizer model 'bert' is not supported"):
        gguf_tokenizer(path)


def test_a_model_with_a_sentencepiece_tokenizer_serves(tmp_path):
    """A Llama-2-shaped file: its prompt tokenized as SentencePiece does, its greedy tokens as
    transformers computes them on the same weights, its text decoded as SentencePiece does."""
    sp = train(True, 800)
    config = LlamaConfig(vocab_size=sp.vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = convert(tmp_path / "hf", tmp_path / "llama2.gguf",
                   tokenizer=lambda w: write_tokenizer(w, sp, add_space_prefix=True))
    prompt = "The tokenizer of a Llama 2 file"
    ids = [1] + sp.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    expected = expected[:expected.index(2)] if 2 in expected else expected   # the server stops at EOS
    with tessera_serve("--model", str(path), "--dtype", "float32", "--kv-cache-gib", "0.02") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=8,
                                      temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    # the continuation's text: its space after the prompt is kept, as llama.cpp and vLLM answer
    assert r.choices[0].text == sp.decode(ids[1:] + expected)[len(prompt):]
