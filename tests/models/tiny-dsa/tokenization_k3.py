"""tokenization_k3.py -- the tokenizer of a k3 checkpoint for Hugging Face's
AutoTokenizer (trust_remote_code), over the checkpoint's tiktoken.model.

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained("models/k3-mini", trust_remote_code=True)
    tok.encode("Hello")          # the ids `k3 tokenize -m models/k3-mini` prints

It encodes as k3 does (src/tokenizer/), id for id:

- ids 0..R-1 are the ranks of tiktoken.model (byte-level BPE, tiktoken's
  merge order), R..R+255 the 256 specials: named by tokenizer_config.json's
  `added_tokens_decoder`, the rest `<|reserved_token_{id}|>`;
- text is split with Kimi's pattern (below) and each piece merged by
  tiktoken;
- long text is cut as Kimi's tokenizer cuts it: chunks of 400,000 code
  points, each cut again so that no slice holds more than 25,000
  consecutive whitespace (str.isspace) or non-whitespace code points;
- all text is ordinary: a special's name inside the text ("[BOS]",
  "<|end_of_msg|>") is split and merged like any other text; only the ids a
  caller adds (add_special_tokens, a chat encoder) are specials. Pass
  split_special_tokens=False to from_pretrained (or to a call) to have named
  specials in the text read as their ids instead.

No BOS or EOS is added (k3 tokenize adds none). Decoding concatenates each
id's bytes (a special's name for a special) and reads them as UTF-8,
invalid sequences as U+FFFD.

Needs transformers and tiktoken only (no torch). The rank file is read by
tiktoken's own loader. Only this file and tokenizer_config.json's auto_map
are needed: tools/hf_tokenizer/install.py puts both into a checkpoint.
"""
import logging
import os
import shutil

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.tokenization_utils_base import AddedToken

logger = logging.getLogger(__name__)

# Kimi's split pattern (fancy-regex syntax, as tiktoken compiles it; `&&` is
# class intersection): Han runs; words with an optional leading non-letter,
# Han excluded from the letter classes; 1-3 digits; punctuation runs; newline
# runs; whitespace.
CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + UPPER + "*" + LOWER + "+" + CONTRACTIONS,
    r"[^\r\n\p{L}\p{N}]?" + UPPER + "+" + LOWER + "*" + CONTRACTIONS,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

N_SPECIALS = 256
CHUNK_CHARS = 400_000
MAX_RUN = 25_000


def _byte_chars():
    """Bytes to printable characters (GPT-2's byte-level table): the token
    strings of the vocabulary, so that every rank has a distinct str."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def slices(text):
    """The pieces k3 and Kimi's tokenizer run the regex on: CHUNK_CHARS code
    points at most, cut where a run of whitespace or of non-whitespace would
    pass MAX_RUN."""
    for c in range(0, len(text), CHUNK_CHARS):
        chunk = text[c:c + CHUNK_CHARS]
        start, run, space = 0, 0, False
        for i, ch in enumerate(chunk):
            sp = ch.isspace()
            if run == 0 or sp != space:
                run, space = 1, sp
            else:
                run += 1
                if run > MAX_RUN:
                    yield chunk[start:i]
                    start, run = i, 1
        if start < len(chunk):
            yield chunk[start:]


class K3Tokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 added_tokens_decoder=None, split_special_tokens=True, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        n = len(ranks)
        if sorted(ranks.values()) != list(range(n)):
            raise ValueError(f"{vocab_file}: the ranks are not 0..{n - 1}")
        self.vocab_file = vocab_file
        self.n_ranks = n
        self._enc = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PATTERN,
                                      mergeable_ranks=ranks, special_tokens={})
        # every special id named: the config's names over the reserved ones
        specials = {i: AddedToken(f"<|reserved_token_{i}|>", special=True, normalized=False)
                    for i in range(n, n + N_SPECIALS)}
        for i, tok in (added_tokens_decoder or {}).items():
            i = int(i)
            if not n <= i < n + N_SPECIALS:
                raise ValueError(f"added token id {i} is outside the special range {n}..{n + N_SPECIALS - 1} "
                                 f"(the rank file has {n} tokens)")
            specials[i] = tok if isinstance(tok, AddedToken) else AddedToken(str(tok), special=True,
                                                                           normalized=False)
        names = [t.content for t in specials.values()]
        if len(set(names)) != len(names):
            raise ValueError("two special ids have the same name")
        self._special_bytes = {i: t.content.encode("utf-8") for i, t in specials.items()}
        chars = _byte_chars()
        by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
        self._tok_str = ["".join(chars[b] for b in tok) for tok, _ in by_rank]
        self._str_id = {s: i for i, s in enumerate(self._tok_str)}
        clash = sorted(set(names) & set(self._str_id))
        if clash:
            logger.warning("K3Tokenizer: ranks spelled like specials (%s): HF's string API maps those strings to "
                           "the specials", ", ".join(clash[:5]))
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=specials, split_special_tokens=split_special_tokens,
                         special_tokens_pattern="none", **kwargs)

    # ---- ids ------------------------------------------------------------

    def encode_ordinary(self, text):
        """The ids of text, every part of it ordinary text (what k3 encodes)."""
        ids = []
        for piece in slices(text):
            ids.extend(self._enc.encode_ordinary(piece))
        return ids

    @property
    def vocab_size(self):
        return self.n_ranks

    def get_vocab(self):
        vocab = dict(self._str_id)
        vocab.update({t.content: i for i, t in self._added_tokens_decoder.items()})
        return vocab

    def _tokenize(self, text, **kwargs):
        return [self._tok_str[i] for i in self.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        i = self._str_id.get(token)
        if i is None:
            if self.unk_token_id is None:
                raise KeyError(f"{token!r} is not a token of this vocabulary")
            return self.unk_token_id
        return i

    def _convert_id_to_token(self, index):
        if 0 <= index < self.n_ranks:
            return self._tok_str[index]
        raise IndexError(f"token id {index} is out of range (vocabulary of {self.n_ranks + N_SPECIALS})")

    def convert_tokens_to_string(self, tokens):
        added = self._added_tokens_encoder
        out = bytearray()
        for t in tokens:
            if t in added and added[t] >= self.n_ranks:
                out += t.encode("utf-8")
            else:
                out += self._enc.decode_single_token_bytes(self._str_id[t])
        return out.decode("utf-8", "replace")

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        out = bytearray()
        for i in token_ids:
            i = int(i)
            if i in skip:
                continue
            if 0 <= i < self.n_ranks:
                out += self._enc.decode_single_token_bytes(i)
            elif i in self._special_bytes:
                out += self._special_bytes[i]
            else:
                raise IndexError(f"token id {i} is out of range (vocabulary of {self.n_ranks + N_SPECIALS})")
        return out.decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        if not os.path.isdir(save_directory):
            raise ValueError(f"{save_directory} is not a directory")
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
