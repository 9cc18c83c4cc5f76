#!/usr/bin/env python3
"""Makes tests/fixtures/tokenizer/: small tokenizer.json files configured like real checkpoints' ones,
trained here with the Hugging Face `tokenizers` library on a corpus written below (there is no Hub
access), and, per tokenizer, cases.json with what the library itself returns for ~65 strings (and, for llama, a
tokenizer_config.json with what transformers' AutoTokenizer makes of the directory).

    /work/main/scripts/reference_python.sh scripts/make_tokenizer_fixtures.py

(scripts/reference_python.sh runs python with the reference environment of
scripts/setup_reference_env.sh, which holds `tokenizers`.) The library is the yardstick only, never a
dependency of moekit; every expected value in the fixtures comes from it.

normalizers.json holds the case texts under the library's NFC, NFD, NFKC and NFKD normalizers.

Tokenizers (each a directory with tokenizer.json and cases.json):
  qwen2        byte-level BPE as Qwen2's: NFC, Split(Qwen2's regex) + ByteLevel(use_regex=false), ByteLevel
               decoder and post-processor; <|endoftext|>, <|im_start|>, <|im_end|> special tokens after the
               vocabulary, <tool_call> a non-special added token
  gpt2         byte-level BPE as GPT-2's: ByteLevel(add_prefix_space=false, use_regex=true); merges written
               in the old "a b" string form
  llama        SentencePiece-style BPE as Mixtral's / Llama-2's: Prepend("▁") + Replace(" ", "▁"), no
               pre-tokenizer, byte_fallback with <0x00>..<0xFF>, decoders Replace, ByteFallback, Fuse,
               Strip; TemplateProcessing adding <s>
  metaspace    Metaspace pre-tokenizer (prepend_scheme "first") and decoder, <unk> with fuse_unk, <s> and
               </s> around the sequence, added tokens with lstrip/rstrip and single_word
  llama3       byte-level BPE as Llama-3's: Llama-3's regex, ignore_merges, Sequence post-processor
               [ByteLevel, TemplateProcessing <|begin_of_text|>]
  split_mix    NFKC + regex Replaces, a Sequence of Split pre-tokenizers with every delimiter behaviour,
               ByteLevel(add_prefix_space=true, use_regex=true), normalized added tokens
"""
import json
import os
import random

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers.decoders import DecodeStream

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "tokenizer")

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")

# The training corpus: English prose, code, numbers, German/Turkish/French with diacritics, Cyrillic,
# Greek, CJK, Korean, emoji, whitespace runs and line ends of both kinds.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog didn't care; it's been sleeping all day.",
    "Mixture-of-Experts layers route every token to a few experts, and the router's weights decide.",
    "We'll see whether they're right: I've heard the model's answers are better when it thinks first.",
    "In 2024, the company shipped 1,234,567 units at $19.99 each; revenue grew 12.5% to 24.6 million.",
    "Call +49 30 1234567 or write to support@example.com before 2025-03-14 12:30:00 UTC.",
    "def forward(self, hidden_states):\n    logits = self.gate(hidden_states)\n    return logits.softmax(-1)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += x[i] * w[i];\n}\nreturn sum;\n",
    "import numpy as np\n\nx = np.arange(10)\nprint(x.sum(), x.mean())\n",
    "if __name__ == \"__main__\":\n    main()\n",
    "Größere Maßstäbe für Übergänge: Äpfel, Öl und Übung machen den Meister. Straße, Fußgänger.",
    "İstanbul'da hava çok güzel; ılık bir rüzgâr esiyor ve insanlar sahilde yürüyüş yapıyor.",
    "Ça coûte cher, n'est-ce pas? L'été dernier, nous étions à Genève près du lac.",
    "Привет, мир! Как дела? Сегодня хорошая погода, и мы идём гулять.",
    "Καλημέρα κόσμε, τι κάνεις σήμερα;",
    "你好，世界！今天天气很好，我们去公园散步吧。机器学习和自然语言处理。",
    "日本語のテキストです。東京は大きな都市で、たくさんの人が住んでいます。",
    "한국어 문장입니다. 서울은 아름다운 도시입니다.",
    "I love emoji 😀😃😄 🎉🎉 👍🏽 ❤️ 🚀 and 👨‍👩‍👧‍👦 families.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 65536 3.14159 2.71828 1e-9 0x1F",
    "Whitespace   runs\t\ttabs    and\n\n\nnewlines\r\nWindows line\r\nends   \n  indented\n",
    "    four spaces\n        eight spaces\n            twelve spaces\n",
    "user: What is the capital of France?\nassistant: The capital of France is Paris.\n",
    "They said \"hello\" and 'goodbye' -- then left... (quietly) [maybe] {surely} <tags> #hash @at 100%!",
]


def corpus_lines():
    lines = []
    for i in range(40):
        lines.extend(CORPUS)
        lines.append(f"Item {i}: value {i * 37 % 1000} at step {i * i} of {i + 1024}.")
    return lines


# Strings checked for every tokenizer: empty, only whitespace, leading/trailing spaces, mixed scripts,
# emoji, characters the corpus never had (byte fallback / unk), long words, digit runs, line ends.
COMMON_CASES = [
    "",
    " ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "Hello world",
    " Hello world",
    "Hello world ",
    "  leading and trailing  ",
    "Hello, world! How are you?",
    "I'm fine, you're great; they'll've it's we'd",
    "DON'T SHOUT, I'M HERE AND IT'S LOUD",
    "'s 'S 'ſ 'K",
    "12345678901234567890",
    "3.14159 and 2,718 and 1e-9",
    "Tel: +49 (0)30 1234567",
    "def foo(x):\n    return x**2  # square\n",
    "int main() {\n\tprintf(\"%d\\n\", 42);\n}",
    "Größenmaßstäbe für Übergänge",
    "İstanbul'da ılık ığdır şöyle çok güzel",
    "Ça coûte cher, n'est-ce pas?",
    "e\u0301te\u0301 A\u030a",
    "ﬁne ①②③ ＡＢＣ１２３",
    "Привет, мир!",
    "Καλημέρα κόσμε",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "你好，世界！",
    "日本語のテキストです。",
    "한국어 문장입니다",
    "Hello世界123abc",
    "I ❤️ emoji 😀🎉👍🏽",
    "👨‍👩‍👧‍👦 family",
    "🦀🦀🦀",
    "🧬 ꙮ 龘䶵",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\u0000\u0001\u007f",
    "a\u180eb a\u00a0b a\u3000b a\u2028b a\u0085b",
    "x \u180e\u180e y \u180e!\u180e \u0085\u0085 z",  # U+180E is not White_Space, U+0085 is
    "a    b\t\tc\n\n\nd",
    "line1\r\nline2\r\n",
    "   \n  \n",
    "end\n",
    "  \n\n  x",
    "Whitespace   runs\t\ttabs",
    "already▁has▁metaspace ▁",
    "<0x41> <unk> <s>",
    "Supercalifragilisticexpialidocious" * 12,
    "x" * 700,
    "1" * 200,
    "é" * 150,
    "😀" * 60,
    "the cat sat on the mat",
    "cat concat cat_ cats",
    "a-b-c -- d. e! f? g,h ,, i",
    "Mixture-of-Experts layers route every token",
    "The capital of France is Paris.\n",
    "\n".join(CORPUS[:6]),
]


def write_fixture(path, fixture):
    """JSON with one line per case, so that a regenerated fixture diffs case by case."""
    def dump(value):
        return json.dumps(value, ensure_ascii=False)

    lines = []
    for key, value in fixture.items():
        if isinstance(value, list):
            lines.append(f"{dump(key)}: [\n" + ",\n".join(dump(v) for v in value) + "\n]")
        elif isinstance(value, dict) and "cases" in value:
            inner = [f"{dump(k)}: {dump(v)}" for k, v in value.items() if k != "cases"]
            inner.append('"cases": [\n' + ",\n".join(dump(v) for v in value["cases"]) + "\n]")
            lines.append(f"{dump(key)}: {{\n" + ",\n".join(inner) + "\n}")
        else:
            lines.append(f"{dump(key)}: {dump(value)}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")


def encode_cases(tok, texts):
    cases = []
    for text in texts:
        with_special = tok.encode(text, add_special_tokens=True).ids
        without_special = tok.encode(text, add_special_tokens=False).ids
        stream = DecodeStream(skip_special_tokens=False)
        chunks = [stream.step(tok, i) for i in with_special]
        cases.append({
            "text": text,
            "ids": with_special,
            "ids_no_special": without_special,
            "decoded": tok.decode(with_special, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(with_special, skip_special_tokens=True),
            "stream": chunks,
        })
    return cases


def decode_cases(tok, seed):
    # Random id sequences: byte tokens out of order (invalid UTF-8), special tokens anywhere; and what the
    # same tokenizer without its decoder makes of them.
    rng = random.Random(seed)
    n = tok.get_vocab_size(with_added_tokens=True)
    bare = Tokenizer.from_str(tok.to_str())
    bare.decoder = None
    cases = []
    for length in [1, 2, 3, 5, 8, 13, 21, 34]:
        ids = [rng.randrange(n) for _ in range(length)]
        cases.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=False),
                      "text_skip_special": tok.decode(ids, skip_special_tokens=True),
                      "text_without_decoder": bare.decode(ids, skip_special_tokens=False)})
    return cases


def token_to_id_exceptions(tok):
    added = tok.get_added_tokens_decoder()
    strings = {t.content for t in added.values()} | {tok.id_to_token(i) for i in added}
    return {s: tok.token_to_id(s) for s in sorted(strings) if tok.token_to_id(s) is None or
            tok.id_to_token(tok.token_to_id(s)) != s}


def save(name, tok, extra_cases, tokenizer_json=None):
    """Writes name/tokenizer.json (tokenizer_json when given: the library is reloaded from it, so the
    cases are what the library makes of exactly the committed file) and name/cases.json."""
    directory = os.path.join(OUT, name)
    os.makedirs(directory, exist_ok=True)
    text = tokenizer_json if tokenizer_json is not None else tok.to_str(pretty=False)
    tok = Tokenizer.from_str(text)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    fixture = {
        "tokenizer": name,
        "library": "tokenizers " + tokenizers.__version__,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        # id_to_token of every id; token_to_id where it is not the token's index: for added tokens the
        # library gives the normalized content from id_to_token but finds them only by their content.
        "id_to_token": [tok.id_to_token(i) for i in range(tok.get_vocab_size(with_added_tokens=True))],
        "token_to_id": token_to_id_exceptions(tok),
        "cases": encode_cases(tok, COMMON_CASES + extra_cases),
        "decode_cases": decode_cases(tok, seed=len(name)),
    }
    write_fixture(os.path.join(directory, "cases.json"), fixture)
    print(f"{name}: vocab {fixture['vocab_size']}, {len(fixture['cases'])} cases")


def train_byte_level(pre_tokenizer, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    return tok


def qwen2():
    split = pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = train_byte_level(pre_tokenizers.Sequence([split, byte_level]), 1200)
    tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    extra = [
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "text<|endoftext|>more text",
        "<|endoftext|>",
        " <|im_end|> ",
        "<|im_start|><|im_end|><|endoftext|>",
        "<|im_start partial <|im_end",
        "call <tool_call>{\"name\": \"f\"}</tool_call>",
    ]
    save("qwen2", tok, extra)


def gpt2():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=900, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    # GPT-2's own tokenizer.json lists merges as "a b" strings; the library still reads that form.
    config = json.loads(tok.to_str())
    config["model"]["merges"] = [f"{a} {b}" for a, b in config["model"]["merges"]]
    extra = ["Hello<|endoftext|>world", "<|endoftext|> <|endoftext|>", "<|endoftext"]
    save("gpt2", tok, extra, tokenizer_json=json.dumps(config, ensure_ascii=False))


def sentencepiece_vocab(tok_trained, specials):
    """A Llama-2-like layout: special tokens, then <0x00>..<0xFF>, then the trained pieces."""
    trained = json.loads(tok_trained.to_str())["model"]
    vocab = {}
    for t in specials + [f"<0x{b:02X}>" for b in range(256)]:
        vocab[t] = len(vocab)
    for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    merges = [tuple(m) for m in trained["merges"]]
    return vocab, merges


def train_metaspace(vocab_size):
    # SentencePiece trains on whitespace-separated pieces; Metaspace(split=True) gives the trainer that.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    return tok


def llama():
    vocab, merges = sentencepiece_vocab(train_metaspace(1000), ["<unk>", "<s>", "</s>"])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>"]])
    # A normalized, non-special added token: matched after the normalizer ran (so as "▁<extra>").
    tok.add_tokens([AddedToken("<extra>", special=False, normalized=True)])
    extra = ["<s>Hello</s>", "<s> Hello </s>", "a<s>b", "< s>", "</s></s>", "x <extra> y<extra>z", "<extra>"]
    save("llama", tok, extra)
    # A tokenizer_config.json as checkpoints ship it, read by moekit's Tokenizer::from_directory; the ids
    # transformers' AutoTokenizer gives from the directory show what of it applies (add_eos_token does not,
    # since transformers 5 leaves the post-processor of tokenizer.json alone).
    config = {"add_bos_token": True, "add_eos_token": True, "bos_token": "<s>", "unk_token": "<unk>",
              "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True},
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    add_transformers_cases("llama", config, ["Hello world", "", "<s>x</s>", "  two  spaces"])


def add_transformers_cases(name, tokenizer_config, texts):
    import transformers
    from transformers import AutoTokenizer
    directory = os.path.join(OUT, name)
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    tok = AutoTokenizer.from_pretrained(directory)
    with open(os.path.join(directory, "cases.json"), encoding="utf-8") as f:
        fixture = json.load(f)
    fixture["transformers"] = {
        "library": "transformers " + transformers.__version__,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "cases": [{"text": t, "ids": tok(t)["input_ids"]} for t in texts],
    }
    write_fixture(os.path.join(directory, "cases.json"), fixture)


def metaspace():
    vocab, merges = sentencepiece_vocab(train_metaspace(700), ["<unk>", "<s>", "</s>"])
    # No byte tokens: drop them so unknown characters become <unk>.
    kept = [t for t in vocab if not (t.startswith("<0x") and len(t) == 6)]
    vocab = {t: i for i, t in enumerate(kept)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B </s>",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>"]])
    tok.add_special_tokens([AddedToken("<mask>", special=True, normalized=False, lstrip=True, rstrip=True)])
    tok.add_tokens([AddedToken("cat", special=False, normalized=True, single_word=True)])
    extra = ["a <mask> b", "a<mask>b", "  <mask>  ", "<mask><mask>", " <mask> <mask> ", "<s><mask></s>",
             "the <mask>. cat", "cat", "tomcat catalog (cat) cat's"]
    save("metaspace", tok, extra)


def llama3():
    split = pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = train_byte_level(pre_tokenizers.Sequence([split, byte_level]), 1000)
    config = json.loads(tok.to_str())
    config["model"]["ignore_merges"] = True
    tok = Tokenizer.from_str(json.dumps(config))
    tok.normalizer = None
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    extra = ["<|begin_of_text|>Hi<|eot_id|>", "1234567 123 12 1", "the theme thermal"]
    save("llama3", tok, extra)


def split_mix():
    tok = train_byte_level(pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True), 800)
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(r"\d{4,}"), "#"),
                                           normalizers.Replace(Regex(r" +$"), ""),
                                           normalizers.Replace(Regex(r"[\s]{3,}"), "\t")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split("-", behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"[.!?]"), behavior="merged_with_next"),
        pre_tokenizers.Split(",", behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n"), behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"[a-z]+"), behavior="merged_with_previous", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
    ])
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("#", "<num>")])
    tok.post_processor = None
    tok.add_special_tokens([AddedToken("[SEP]", special=True, normalized=False, rstrip=True)])
    tok.add_tokens([AddedToken("ﬁx", special=False, normalized=True, lstrip=True),
                    AddedToken("word", special=False, normalized=False, single_word=True)])
    extra = ["a-b-c -- d. e! f? g,h ,, i", "one\n\n\ntwo\nthree", "fix ﬁx  ﬁx", "[SEP]  next [SEP]",
             "word words sword word_ (word) wörd word", "year 2024 and 12345 and 7", "trailing  \nspaces \n end  "]
    save("split_mix", tok, extra)


def unicode_normalizers():
    """normalizers.json: each case text under the library's NFC, NFD, NFKC and NFKD normalizers."""
    forms = {"NFC": normalizers.NFC(), "NFD": normalizers.NFD(), "NFKC": normalizers.NFKC(),
             "NFKD": normalizers.NFKD()}
    # Beyond the case texts: canonical and compatibility equivalents, reordering of combining marks,
    # Hangul syllables and jamo, singletons (Angstrom sign, Ohm sign), and characters NFC must not compose.
    texts = COMMON_CASES + ["\u212b \u2126 \u00c5 \u0041\u030a", "\u1100\u1161\u11a8 \uac01", "e\u0323\u0302 \u1ec7",
                            "a\u0301\u0323 a\u0323\u0301", "\u1e9b\u0323", "\u0958 \u2adc \ufb2c",
                            "\u00bd \u2163 \u33a1 \u3250 \ufdfa", "\u0130\u0307 \u03d3 \u0344"]
    fixture = {"library": "tokenizers " + tokenizers.__version__}
    for name, normalizer in forms.items():
        fixture[name] = [[text, normalizer.normalize_str(text)] for text in texts]
    write_fixture(os.path.join(OUT, "normalizers.json"), fixture)
    print(f"normalizers: {len(texts)} texts")


if __name__ == "__main__":
    for make in [qwen2, gpt2, llama, metaspace, llama3, split_mix, unicode_normalizers]:
        make()
