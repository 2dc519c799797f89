"""Token datasets for language models: a learnable synthetic stream and a real byte-level corpus.

A split holds fixed windows of `seq_len + 1` tokens as one integer tensor; a batch is
(x, y) = (window[:, :-1], window[:, 1:]) as int64 [B, T]: next-token prediction. Windows do not
overlap and do not move between epochs, so an epoch is a pass over every token once.

`dataset=text` is the Python standard library's own sources, read from the running Python's
`stdlib` folder (every machine that runs memtrain has them; nothing to download): a pinned list of
files, byte-level tokens (vocabulary 256), a fixed split by file (every tenth file is held out).
The sources differ between Python versions, so the row records the corpus' content hash and the
Python version it came from (`data_hash`, `data_source`).
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from memtrain.data import Data, Split, _batch_indices, check_folder, check_memory, options_check
from memtrain.errors import ConfigError, check_range

# Plain modules present, as files of these names, in CPython 3.10 to 3.13 (none became a
# package or a shim in that range). Sorted; every tenth (index % 10 == 9) is validation.
STDLIB_FILES = (
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "cmd.py", "codecs.py",
    "colorsys.py", "configparser.py", "contextlib.py", "copy.py", "csv.py", "dataclasses.py",
    "difflib.py", "dis.py", "enum.py", "fnmatch.py", "fractions.py", "ftplib.py", "functools.py",
    "getopt.py", "gettext.py", "glob.py", "gzip.py", "heapq.py", "hmac.py", "inspect.py",
    "ipaddress.py", "json/decoder.py", "json/encoder.py", "keyword.py", "linecache.py",
    "locale.py", "logging/__init__.py", "mimetypes.py", "numbers.py", "operator.py",
    "optparse.py", "os.py", "pickle.py", "pprint.py", "queue.py", "quopri.py", "random.py",
    "reprlib.py", "sched.py", "secrets.py", "selectors.py", "shlex.py", "shutil.py", "signal.py",
    "smtplib.py", "socket.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py",
    "tempfile.py", "textwrap.py", "threading.py", "timeit.py", "tokenize.py", "trace.py",
    "traceback.py", "types.py", "typing.py", "uuid.py", "warnings.py", "weakref.py",
)
CORPORA = ("python_stdlib",)


@dataclass
class TokenSplit(Split):
    """Windows of `seq_len + 1` token ids [N, seq_len + 1] (uint8 for byte vocabularies)."""

    windows: torch.Tensor

    def __len__(self) -> int:
        return self.windows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.windows.numel() * self.windows.element_size()

    def to(self, device: torch.device) -> TokenSplit:
        return TokenSplit(self.windows.to(device))

    def batches(self, batch_size, device, shuffle=False, generator=None, drop_last=False):
        for idx in _batch_indices(len(self), batch_size, shuffle, generator, drop_last):
            w = self.windows[idx.to(self.windows.device)].to(device, non_blocking=True).long()
            yield w[:, :-1], w[:, 1:]  # [B, T] inputs, [B, T] next tokens

    def __getitem__(self, i: int):
        w = self.windows[i].long()
        return w[:-1], w[1:]


def unigram_loss(train: torch.Tensor, test: torch.Tensor, vocab_size: int) -> float:
    """Mean loss (nats per token) on `test`'s predicted tokens of the unigram model fitted on
    `train` (add-one smoothed): what a language model that ignores context achieves. A model
    that does not get below it has not learned (memtrain.run.learned)."""
    counts = torch.bincount(train[:, 1:].reshape(-1).long(), minlength=vocab_size).double() + 1
    logp = counts.log() - counts.sum().log()
    return float(-logp[test[:, 1:].reshape(-1).long()].mean())


def _windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = stream.numel() // (seq_len + 1)
    return stream[: n * (seq_len + 1)].view(n, seq_len + 1)


def _lm_data(name: str, train: torch.Tensor, test: torch.Tensor, vocab_size: int, seq_len: int,
             **extra) -> Data:
    return Data(TokenSplit(train), TokenSplit(test), vocab_size, (seq_len,), name, task="lm",
                unigram_loss=unigram_loss(train, test, vocab_size), **extra)


# Up to this vocabulary a token's successors are the first `branching` of a permutation of its
# own (V permutations of V tokens: V^2 draws, bounded here), the chain this dataset has drawn
# since it exists, so its rows keep measuring the same data; above it, O(V x branching) draws.
PERMUTED_VOCAB = 4096


def _check_tokens(seed: int = 0, vocab_size: int = 256, seq_len: int = 128,
                  train_size: int = 2000, test_size: int = 200, branching: int = 4, *,
                  here: bool = True) -> None:
    """tokens' options, and the memory building it takes: the sequences as int64 while they
    are drawn and in their stored dtype, the successor table and the per-token draws."""
    check_range("dataset.vocab_size", vocab_size, 2, 1 << 20)
    check_range("dataset.seq_len", seq_len, 1, 1 << 20)
    check_range("dataset.train_size", train_size, 1, 1 << 31)
    check_range("dataset.test_size", test_size, 1, 1 << 31)
    check_range("dataset.branching", branching, 1, vocab_size)
    if here:
        n = train_size + test_size
        stored = 1 if vocab_size <= 256 else 4
        check_memory({f"dataset.{k}": v for k, v in (
            ("train_size", train_size), ("test_size", test_size), ("seq_len", seq_len),
            ("vocab_size", vocab_size), ("branching", branching))},
            n * (seq_len + 1) * (8 + stored) + n * 8 * 4 + vocab_size * (2 * branching + 6) * 8,
            f"{n} sequences of {seq_len + 1} tokens and a chain of {vocab_size} tokens with "
            f"{branching} successors each")


def successors(vocab_size: int, branching: int, g: torch.Generator) -> torch.Tensor:
    """[V, branching] int64: each token's distinct successors, drawn with `g`.

    Up to PERMUTED_VOCAB: the first `branching` of a random permutation per token (each slice
    copied out, so no V-long permutation outlives its row). Above: token v's successors are
    perm[(a_v + b_v * j) mod V] for j < branching, with one random permutation `perm`, a random
    offset a_v and a random step b_v coprime to V (so the branching indices are distinct):
    memory and time O(V x branching)."""
    if vocab_size <= PERMUTED_VOCAB:
        return torch.stack([torch.randperm(vocab_size, generator=g)[:branching].clone()
                            for _ in range(vocab_size)])
    perm = torch.randperm(vocab_size, generator=g)
    offset = torch.randint(vocab_size, (vocab_size, 1), generator=g)
    step = torch.randint(1, vocab_size, (vocab_size, 1), generator=g)
    v = torch.tensor(vocab_size)
    while (shared := torch.gcd(step, v) != 1).any():  # at least 1 in 6 is coprime
        step[shared] = torch.randint(1, vocab_size, (int(shared.sum()),), generator=g)
    return perm[(offset + step * torch.arange(branching)) % vocab_size]


@options_check(_check_tokens)
def tokens(seed: int = 0, vocab_size: int = 256, seq_len: int = 128, train_size: int = 2000,
           test_size: int = 200, branching: int = 4) -> Data:
    """Seeded synthetic token streams a model can learn: a random sparse Markov chain in which
    each token is followed by one of `branching` successors (Zipf-weighted), so the next-token
    loss a model can reach (about the chain's entropy) is far below the unigram loss."""
    _check_tokens(seed, vocab_size, seq_len, train_size, test_size, branching)
    n = train_size + test_size
    g = torch.Generator().manual_seed(seed)
    succ = successors(vocab_size, branching, g)  # [V, branching]
    weights = 1.0 / torch.arange(1, branching + 1, dtype=torch.float64)  # Zipf over successors
    cum = (weights / weights.sum()).cumsum(0)
    cur = torch.randint(vocab_size, (n,), generator=g)
    out = torch.empty(n, seq_len + 1, dtype=torch.int64)
    for t in range(seq_len + 1):  # all sequences step together: seq_len + 1 vector steps
        out[:, t] = cur
        pick = torch.searchsorted(cum, torch.rand(n, generator=g, dtype=torch.float64))
        cur = succ[cur, pick.clamp_(max=branching - 1)]
    dtype = torch.uint8 if vocab_size <= 256 else torch.int32
    windows = out.to(dtype)
    return _lm_data("tokens", windows[:train_size], windows[train_size:], vocab_size, seq_len)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _check_text(corpus: str = "python_stdlib", seq_len: int = 128,
                data_dir: str | None = None, *, here: bool = True) -> None:
    """text's options; on this machine, its files and the memory reading them takes (each
    file's bytes, joined, and copied once more into the token buffer)."""
    if corpus not in CORPORA:
        raise ConfigError(f"dataset.corpus={corpus!r} is not one of {', '.join(CORPORA)}")
    check_range("dataset.seq_len", seq_len, 1, 1 << 20)
    check_folder(data_dir)
    if not here:
        return
    root = _root(data_dir)
    missing = [f for f in STDLIB_FILES if not (root / f).is_file()]
    if missing:
        raise ConfigError(f"dataset=text: {len(missing)} of the corpus' files are missing under "
                          f"{root} (first: {missing[0]}); set dataset.data_dir to a Python "
                          f"standard library folder that has them")
    size = sum((root / f).stat().st_size for f in STDLIB_FILES)
    check_memory({"dataset.data_dir": data_dir}, 3 * size,
                 f"the corpus' {len(STDLIB_FILES)} files ({size} bytes) under {root}")


def _root(data_dir: str | None) -> Path:
    return Path(data_dir).expanduser() if data_dir else stdlib_root()


@options_check(_check_text)
def text(corpus: str = "python_stdlib", seq_len: int = 128, data_dir: str | None = None) -> Data:
    """A real corpus as byte-level tokens (vocabulary 256). `python_stdlib`: the pinned files of
    the Python standard library (from `data_dir` when set, else the running Python's). The row's
    `data_source` names what was read: the running Python's standard library, or the folder."""
    _check_text(corpus, seq_len, data_dir)
    root = _root(data_dir)
    digest, parts = hashlib.sha256(), {"train": [], "test": []}
    for i, name in enumerate(STDLIB_FILES):
        raw = (root / name).read_bytes()
        digest.update(name.encode() + b"\0" + raw + b"\0")
        parts["test" if i % 10 == 9 else "train"].append(raw)
    streams = {k: torch.frombuffer(bytearray(b"\n".join(v)), dtype=torch.uint8)
               for k, v in parts.items()}
    train, test = (_windows(streams[k], seq_len) for k in ("train", "test"))
    if len(test) == 0:
        raise ConfigError(f"dataset.seq_len={seq_len} is longer than the validation files "
                          f"({streams['test'].numel()} bytes); lower it")
    read = (f"python{'.'.join(platform.python_version_tuple()[:2])} stdlib" if not data_dir
            else str(root.resolve()))
    source = (f"{read}, {len(STDLIB_FILES)} files, "
              f"{sum(s.numel() for s in streams.values())} bytes")
    return _lm_data("text", train, test, 256, seq_len, data_hash=digest.hexdigest()[:16],
                    data_source=source)

