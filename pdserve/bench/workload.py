"""What a benchmark sends: seeded synthetic prompts of chosen lengths, or prompts from a JSONL file.

A length is a distribution spec: `128` (fixed), `uniform:64,256` (inclusive), `normal:128,32`
(clipped to mean +- 3 std and at least 1) or `normal:128,32,16,512` (clipped to [16, 512]).

Synthetic prompts are seeded random sentences from a built-in word list. With a tokenizer their
length is exact in tokens (of the text itself: a chat template adds its own tokens, which the
server's `usage.prompt_tokens` counts); without one, a prompt of length n is n words, which most
tokenizers of English turn into roughly n tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.model.path import ModelLoadError
from pdserve.engine.model.tokenizer import load_tokenizer


class BenchError(ValueError):
    """A user error (bad flag, bad file, unreachable server): printed without a traceback."""


@dataclass(frozen=True)
class LengthDist:
    kind: str  # "fixed" | "uniform" | "normal"
    a: float  # fixed value | uniform low | normal mean
    b: float = 0.0  # uniform high | normal std
    lo: int = 1
    hi: int = 1

    @classmethod
    def parse(cls, flag: str, spec: str) -> LengthDist:
        def ints(text: str, n: tuple[int, ...]) -> list[float]:
            try:
                vals = [float(v) for v in text.split(",")]
            except ValueError:
                vals = []
            if len(vals) not in n:
                raise BenchError(
                    f"{flag}: cannot read {spec!r}; use N, uniform:LOW,HIGH or "
                    "normal:MEAN,STD[,MIN,MAX]"
                )
            return vals

        kind, _, rest = spec.partition(":")
        if not rest:
            (n,) = ints(spec, (1,))
            if n < 1 or n != int(n):
                raise BenchError(f"{flag}: a length must be a whole number >= 1, got {spec!r}")
            return cls("fixed", n, lo=int(n), hi=int(n))
        if kind == "uniform":
            low, high = ints(rest, (2,))
            if not 1 <= low <= high or low != int(low) or high != int(high):
                raise BenchError(
                    f"{flag}: uniform:LOW,HIGH needs whole numbers 1 <= LOW <= HIGH, got {spec!r}"
                )
            return cls("uniform", low, high, int(low), int(high))
        if kind == "normal":
            vals = ints(rest, (2, 4))
            mean, std = vals[0], vals[1]
            lo, hi = (
                (vals[2], vals[3]) if len(vals) == 4 else (max(1.0, mean - 3 * std), mean + 3 * std)
            )
            if std < 0 or not 1 <= lo <= hi or mean < 1:
                raise BenchError(
                    f"{flag}: normal needs MEAN >= 1, STD >= 0 and 1 <= MIN <= MAX, got {spec!r}"
                )
            return cls("normal", mean, std, int(round(lo)), int(round(hi)))
        raise BenchError(
            f"{flag}: unknown distribution {kind!r}; use N, uniform:LOW,HIGH or normal:MEAN,STD"
        )

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.lo
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        return min(self.hi, max(self.lo, round(rng.gauss(self.a, self.b))))

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.lo)
        if self.kind == "uniform":
            return f"uniform:{self.lo},{self.hi}"
        return f"normal:{self.a:g},{self.b:g},{self.lo},{self.hi}"


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. Exactly one of `prompt` (text) and `messages` (chat) is set."""

    prompt: str | None
    messages: tuple[dict, ...] | None
    max_tokens: int
    prompt_tokens: int | None  # counted by the client's tokenizer; None without one
    prompt_words: int

    def chat_messages(self) -> list[dict]:
        return list(self.messages) if self.messages else [{"role": "user", "content": self.prompt}]


# Our own small vocabulary for synthetic text: plain words about machines, weather and travel.
# fmt: off
_NOUNS = [
    "river", "engine", "garden", "signal", "window", "harbor", "lantern", "ledger", "orbit",
    "meadow", "circuit", "valley", "compass", "tower", "kettle", "bridge", "forest", "canvas",
    "market", "mirror", "planet", "saddle", "thunder", "violin", "pocket", "ribbon", "anchor",
    "beacon", "cellar", "desert", "falcon", "glacier", "island", "jacket", "ladder", "marble",
    "needle", "pepper", "quartz", "rocket", "summit", "tunnel", "umbrella", "velvet", "wagon",
    "yarn", "zenith", "copper", "morning", "evening", "letter", "number", "station", "voyage",
    "winter", "summer", "question", "answer",
]
_VERBS = [
    "carries", "follows", "gathers", "holds", "lifts", "measures", "opens", "paints", "reaches",
    "shapes", "turns", "watches", "builds", "crosses", "draws", "finds", "guides", "keeps", "moves",
    "pulls", "sends", "writes", "brings", "counts", "drops", "folds", "hears", "joins", "leaves",
    "names",
]
_ADJS = [
    "quiet", "bright", "heavy", "narrow", "gentle", "hollow", "early", "silver", "green", "rapid",
    "distant", "steady", "golden", "humble", "plain", "sharp", "tidy", "warm", "young", "ancient",
    "careful", "curious",
]
# fmt: on
_SMALL = (
    ["the", "a", "one", "each", "every", "some", "this", "that"],
    ["of", "near", "over", "under", "beside", "across", "through", "behind", "along"],
    ["and", "but", "while", "so", "yet"],
)


def _sentence(rng: random.Random) -> list[str]:
    det, prep, conj = _SMALL
    words = [
        rng.choice(det),
        rng.choice(_ADJS),
        rng.choice(_NOUNS),
        rng.choice(_VERBS),
        rng.choice(det),
        rng.choice(_NOUNS),
    ]
    for _ in range(rng.randint(0, 2)):
        words += [rng.choice(prep), rng.choice(det), rng.choice(_ADJS), rng.choice(_NOUNS)]
    if rng.random() < 0.3:
        words += [rng.choice(conj), rng.choice(det), rng.choice(_NOUNS), rng.choice(_VERBS)]
    words[0] = words[0].capitalize()
    words[-1] += rng.choice(".;!?.")
    return words


def random_words(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        out += _sentence(rng)
    return out[:n]


def _load(path: str):
    """A local folder or GGUF file loads as a node front loads it (engine/model/tokenizer.py: a
    plain fast tokenizer without importing torch, about 2.5 s of CPU here); a hub name through
    AutoTokenizer."""
    if Path(path).is_dir() or path.endswith(".gguf"):
        return load_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class TokenCounter:
    """A Hugging Face tokenizer used to count and build prompts of exact token lengths."""

    def __init__(self, path: str):
        try:
            self.tok = _load(path)
        except (OSError, ValueError, ModelLoadError) as e:
            raise BenchError(f"--tokenizer: cannot load a tokenizer from {path!r}: {e}") from None
        self._fillers = [w for w in _NOUNS + _VERBS + _ADJS + _SMALL[0] if self.count(" " + w) == 1]

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def exact_text(self, rng: random.Random, n: int) -> tuple[str, int]:
        """Seeded text of exactly `n` tokens (or the nearest count the tokenizer allows)."""
        words = random_words(rng, n)
        while self.count(" ".join(words)) < n:  # a word is at least one token: rarely loops
            words += random_words(rng, n)
        lo, hi = 0, len(words)  # largest prefix of words with <= n tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(" ".join(words[:mid])) <= n:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[:lo])
        have = self.count(text)
        fillers = list(self._fillers) or ["a"]
        while have < n:
            rng.shuffle(fillers)
            for w in fillers:  # a one-token word that adds exactly one token here
                cand = f"{text} {w}" if text else w
                if self.count(cand) == have + 1:
                    text, have = cand, have + 1
                    break
            else:
                break
        return text, have


class Workload:
    """Seeded requests: `requests(n, key)` gives the same list for the same seed and key."""

    def __init__(
        self,
        *,
        isl: LengthDist,
        osl: LengthDist,
        seed: int,
        tokenizer: TokenCounter | None = None,
        dataset: list[dict] | None = None,
    ):
        self.isl, self.osl, self.seed = isl, osl, seed
        self.tokenizer = tokenizer
        self.dataset = dataset

    def requests(self, n: int, key: str) -> list[BenchRequest]:
        rng = random.Random(f"pdserve-bench/{self.seed}/{key}")
        if self.dataset is not None:
            return [self._from_entry(self.dataset[i % len(self.dataset)], rng) for i in range(n)]
        return [self._synthetic(rng) for _ in range(n)]

    def _synthetic(self, rng: random.Random) -> BenchRequest:
        isl, osl = self.isl.sample(rng), self.osl.sample(rng)
        if self.tokenizer is not None:
            text, count = self.tokenizer.exact_text(rng, isl)
            return BenchRequest(text, None, osl, count, len(text.split()))
        text = " ".join(random_words(rng, isl))
        return BenchRequest(text, None, osl, None, isl)

    def _from_entry(self, entry: dict, rng: random.Random) -> BenchRequest:
        max_tokens = entry.get("max_tokens") or self.osl.sample(rng)
        if "prompt" in entry:
            text = entry["prompt"]
            count = self.tokenizer.count(text) if self.tokenizer else None
            return BenchRequest(text, None, max_tokens, count, len(text.split()))
        msgs = tuple(entry["messages"])
        content = " ".join(m["content"] for m in msgs)
        count = self.tokenizer.count(content) if self.tokenizer else None
        return BenchRequest(None, msgs, max_tokens, count, len(content.split()))


def load_jsonl(path: str) -> list[dict]:
    """Entries `{"prompt": str}` or `{"messages": [{"role", "content"}...]}`,
    optional `max_tokens`."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise BenchError(f"--dataset: cannot read {path}: {e.strerror or e}") from None
    entries = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--dataset {path}:{lineno}"
        try:
            entry = json.loads(line)
        except ValueError as e:
            raise BenchError(f"{where}: not JSON ({e})") from None
        if not isinstance(entry, dict):
            raise BenchError(f"{where}: each line must be a JSON object")
        if ("prompt" in entry) == ("messages" in entry):
            raise BenchError(f"{where}: give exactly one of 'prompt' and 'messages'")
        if "prompt" in entry and not (isinstance(entry["prompt"], str) and entry["prompt"]):
            raise BenchError(f"{where}: 'prompt' must be a non-empty string")
        if "messages" in entry:
            msgs = entry["messages"]
            if not (
                isinstance(msgs, list)
                and msgs
                and all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in msgs
                )
            ):
                raise BenchError(
                    f"{where}: 'messages' must be a non-empty list of "
                    "{'role': str, 'content': str}"
                )
        mt = entry.get("max_tokens")
        if mt is not None and not (isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1):
            raise BenchError(f"{where}: 'max_tokens' must be an integer >= 1")
        entries.append(entry)
    if not entries:
        raise BenchError(f"--dataset: {path} has no entries")
    return entries
