"""Synthetic K3-format chat dialogues built from the training text (docs/model.md §5).

Each dialogue is encoded segment by segment (control tokens are single special ids; tag
names, attributes and contents are separately tokenized text segments):

  <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>
  <|open|>message role="assistant"<|sep|>[<|open|>think<|sep|>R<|close|>think<|sep|>]
      <|open|>response<|sep|>TEXT<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>

The think block is, in equal parts, absent, empty, or a one-line reasoning, so both
generation prompts (thinking: up to <|open|>think<|sep|>; non-thinking: up to
<|open|>response<|sep|>) lead to an answer-shaped turn ending with <|end_of_msg|>.
Tasks: continue a passage; name the source of a passage; quote a KJV verse; a few fixed
identity questions.
"""
import random
import re

SOURCE_NAMES = {
    "austen": "a novel by Jane Austen",
    "brown": "the Brown corpus of American English",
    "kjv": "the King James Bible",
    "mobydick": "Moby Dick, by Herman Melville",
    "sotu": "a State of the Union address",
}

CONTINUE_PROMPTS = [
    "Continue this passage:\n\n{p}",
    "Please continue the text below.\n\n{p}",
    "What comes next?\n\n{p}",
    "Write the next few sentences after this:\n{p}",
    "{p}",
    "Continue: {p}",
]
SOURCE_PROMPTS = [
    "Which text is this passage from?\n\n{p}",
    "Where does this come from? \"{p}\"",
    "Identify the source of this passage:\n{p}",
]
VERSE_PROMPTS = [
    "What does {ref} say?",
    "Quote {ref} from the King James Bible.",
    "Recite {ref}.",
]
IDENTITY = [
    ("Who are you?", "I am k3-mini, a small language model trained on public-domain books, "
     "speeches and the Bible."),
    ("What can you do?", "I can continue a passage of English text, tell you which of my "
     "training texts a passage resembles, and quote verses from the King James Bible."),
    ("Hello!", "Hello! Give me the beginning of a passage and I will continue it."),
    ("What is your name?", "My name is k3-mini."),
]
THINK = {
    "continue": "The user wants the passage continued in the same style.",
    "source": "I should name the text this passage comes from.",
    "verse": "The user asks for a Bible verse; I will quote it.",
    "identity": "The user asks about me.",
}

_SENT = re.compile(r"(?<=[.!?])[\"'”’)]?\s+")


def take(text, start, n):
    """Up to n sentences starting exactly at start (each at most 400 chars)."""
    out, p = [], start
    for _ in range(n):
        m = _SENT.search(text, p)
        if not m or m.start() - p > 400:
            break
        out.append(text[p:m.end()].strip())
        p = m.end()
    return out, p


def sentences(text, pos, n):
    """Up to n sentences starting at the first sentence start after pos."""
    m = _SENT.search(text, pos)
    if not m:
        return None, pos
    return take(text, m.end(), n)


def clean(s):
    return re.sub(r"\s+", " ", s).strip()


def parse_kjv(text):
    verses = []
    book = None
    for line in text.split("\n"):
        m = re.match(r"^(\S.*?) (\d+)$", line)
        if m:
            book, chap = m.group(1), m.group(2)
            continue
        m = re.match(r"^\s+(\d+) (.+)$", line)
        if m and book:
            verses.append((f"{book} {chap}:{m.group(1)}", m.group(2).strip()))
    return verses


class ChatEncoder:
    def __init__(self, enc, specials_by_name):
        self.enc = enc
        self.sp = specials_by_name

    def t(self, s):
        return self.enc.encode_ordinary(s) if s else []

    def msg(self, role, text=None, think=None):
        S, t = self.sp, self.t
        ids = [S["<|open|>"]] + t("message") + t(" role") + t('="') + t(role) + t('"') + [S["<|sep|>"]]
        if role == "assistant":
            if think is not None:
                ids += [S["<|open|>"]] + t("think") + [S["<|sep|>"]] + t(think) + \
                       [S["<|close|>"]] + t("think") + [S["<|sep|>"]]
            ids += [S["<|open|>"]] + t("response") + [S["<|sep|>"]] + t(text) + \
                   [S["<|close|>"]] + t("response") + [S["<|sep|>"]]
        else:
            ids += t(text)
        ids += [S["<|close|>"]] + t("message") + [S["<|sep|>"], S["<|end_of_msg|>"]]
        return ids


def make_dialogues(train_texts, enc, specials_by_name, n_tokens, seed=1234):
    """Token ids of dialogues totalling about n_tokens; returns list of id lists."""
    rng = random.Random(seed)
    ce = ChatEncoder(enc, specials_by_name)
    names = sorted(train_texts)
    verses = parse_kjv(train_texts["kjv"])
    out, tot = [], 0
    while tot < n_tokens:
        r = rng.random()
        if r < 0.6:
            kind = "continue"
        elif r < 0.8:
            kind = "source"
        elif r < 0.97:
            kind = "verse"
        else:
            kind = "identity"
        if kind in ("continue", "source"):
            name = rng.choice(names)
            text = train_texts[name]
            sents, p = sentences(text, rng.randrange(len(text) - 5000), rng.randint(1, 3))
            if not sents:
                continue
            passage = clean(" ".join(sents))
            if kind == "continue":
                cont, _ = take(text, p, rng.randint(1, 3))
                cont_s = clean(" ".join(cont))
                if not passage or not cont_s or len(passage) > 600 or len(cont_s) > 600:
                    continue
                user = rng.choice(CONTINUE_PROMPTS).format(p=passage)
                answer = cont_s
            else:
                if len(passage) > 600:
                    continue
                user = rng.choice(SOURCE_PROMPTS).format(p=passage)
                answer = f"This passage is from {SOURCE_NAMES[name]}."
        elif kind == "verse":
            ref, verse = rng.choice(verses)
            user = rng.choice(VERSE_PROMPTS).format(ref=ref)
            answer = f"{ref} says: {verse}"
        else:
            user, answer = rng.choice(IDENTITY)
        mode = rng.randrange(3)
        think = None if mode == 0 else ("" if mode == 1 else THINK[kind])
        ids = []
        if rng.random() < 0.25:
            ids += ce.msg("system", "You are k3-mini, a helpful assistant.")
        ids += ce.msg("user", user) + ce.msg("assistant", answer, think)
        out.append(ids)
        tot += len(ids)
    return out
