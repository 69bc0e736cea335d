"""Gemma's SentencePiece tokenizer, rebuilt from the GGUF's own vocabulary.

The file has pieces, scores and token types but no merges. A `tokenizers` BPE
built from the vocabulary alone reproduces SentencePiece exactly:
1. merges = every split of each normal piece (in id order, which is score
   order) whose two halves are both normal pieces;
2. spaces are normalized to "▁"; byte fallback covers characters not in the
   vocabulary ("<0xNN>" pieces);
3. control pieces (<bos>, <start_of_turn>, ...) are special added tokens,
   user-defined pieces (newline/tab runs, HTML tags) are added whole, and the
   space-run pieces (stored with real spaces) are added as "▁" runs matched
   after normalization.
The built tokenizer is cached as tokenizer.json in the cache dir by sha256.

Decoding is done here, not by `tokenizers`: byte-fallback runs are decoded with
an incremental UTF-8 decoder, so streaming (`IncrementalDecoder`) and
`Tokenizer.decode` agree exactly by construction.
"""

from __future__ import annotations

import codecs
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from gguf.constants import TokenType
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as _Backend

from engine.model.chat import apply_chat_template, chat_segments
from engine.model.gguf_file import GGUFFile, WeightsError, cache_dir, default_gguf_path, file_sha256
from engine.runtime.progress import Reporter, Steps

__all__ = ["Tokenizer", "IncrementalDecoder", "apply_chat_template", "build_backend"]

CACHE_FORMAT = "v1"
SPACE = "▁"
_NORMAL, _USER, _BYTE = int(TokenType.NORMAL), int(TokenType.USER_DEFINED), int(TokenType.BYTE)
_SPECIAL_TYPES = (int(TokenType.CONTROL), int(TokenType.UNKNOWN))


def _is_space_run(piece: str, ttype: int) -> bool:
    return ttype == _USER and piece != "" and set(piece) == {" "}


def _merges(pieces: Sequence[str], types: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) split of each normal piece whose halves are normal pieces, by id."""
    normal = np.flatnonzero(np.asarray(types) == _NORMAL).tolist()
    known = {pieces[i] for i in normal}
    merges = []
    for i in normal:
        piece = pieces[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                merges.append((left, right))
    return merges


def build_backend(pieces: Sequence[str], types: np.ndarray, unk: str = "<unk>") -> _Backend:
    """A `tokenizers.Tokenizer` equivalent to the SentencePiece model (see module doc)."""
    kinds: list[int] = np.asarray(types).tolist()  # plain ints: numpy scalar compares are slow
    vocab: dict[str, int] = {}
    for i, (piece, ttype) in enumerate(zip(pieces, kinds)):
        vocab.setdefault(piece.replace(" ", SPACE) if _is_space_run(piece, ttype) else piece, i)
    merges = _merges(pieces, types)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True)
    backend = _Backend(model)
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.add_special_tokens(
        [AddedToken(p, special=True, normalized=False) for p, t in zip(pieces, kinds) if t in _SPECIAL_TYPES]
    )
    backend.add_tokens([
        AddedToken(p.replace(" ", SPACE), special=False, normalized=True)
        if _is_space_run(p, t) else AddedToken(p, special=False, normalized=False)
        for p, t in zip(pieces, kinds) if t == _USER
    ])
    return backend


def _load_backend(gf: GGUFFile, pieces: list[str], types: np.ndarray, progress: Reporter) -> _Backend:
    sha = file_sha256(gf.path, progress=progress)
    cached = cache_dir() / f"tokenizer-{sha[:24]}-{CACHE_FORMAT}.json"
    if cached.is_file():
        try:
            return _Backend.from_file(str(cached))
        except Exception:  # a damaged cache file: build it again
            cached.unlink(missing_ok=True)
    with Steps(progress, f"building tokenizer from {gf.path.name}", 2) as bar:
        backend = build_backend(pieces, types)
        bar.advance()
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        try:
            backend.save(str(tmp))
            os.replace(tmp, cached)
        except Exception:  # an unwritable cache only costs a rebuild next time
            tmp.unlink(missing_ok=True)
    return backend


class Tokenizer:
    """Text <-> token ids for a Gemma 3 vocabulary.

    >>> tok = Tokenizer.from_gguf()                       # doctest: +SKIP
    >>> tok.encode("Hello world")                         # doctest: +SKIP
    [2, 9259, 1902]
    """

    def __init__(self, backend: _Backend, pieces: list[str], types: np.ndarray, bos_id: int,
                 eos_id: int) -> None:
        self._backend = backend
        self._lock = threading.Lock()  # encode_plain flips the backend's special-token mode
        self.bos_id, self.eos_id = bos_id, eos_id
        self.end_of_turn_id = backend.token_to_id("<end_of_turn>")
        self.start_of_turn_id = backend.token_to_id("<start_of_turn>")
        self.stop_ids = tuple(dict.fromkeys(i for i in (eos_id, self.end_of_turn_id) if i is not None))
        """Ids that end a generation: EOS and <end_of_turn>."""
        types = np.asarray(types)
        self._special: list[bool] = np.isin(types, _SPECIAL_TYPES).tolist()
        self._byte = [-1] * len(pieces)
        for i in np.flatnonzero(types == _BYTE).tolist():
            self._byte[i] = int(pieces[i][3:5], 16)
        self._text = [p if s else p.replace(SPACE, " ") for p, s in zip(pieces, self._special)]
        self._marked = [s or (t == _USER and p.startswith("<") and p.endswith(">") and len(p) > 2)
                        for p, s, t in zip(pieces, self._special, types.tolist())]
        self.max_piece_chars = max(map(len, self._text), default=1)
        """Most characters one token covers (31 for Gemma 3): a text of n characters encodes to
        at least n / max_piece_chars tokens, a bound known before tokenizing it."""

    @classmethod
    def from_gguf(cls, path: str | Path | None = None, progress: Reporter = True) -> Tokenizer:
        """The tokenizer of a GGUF file (default: the bundled Gemma 3 270M)."""
        gf = GGUFFile.open(default_gguf_path(progress) if path is None else path)
        meta = gf.metadata
        pieces = meta.get("tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type")
        if meta.get("tokenizer.ggml.model") != "llama" or not pieces or types is None:
            raise WeightsError(
                f"{gf.path} has no SentencePiece vocabulary (tokenizer.ggml.model = "
                f"{meta.get('tokenizer.ggml.model')!r}); a Gemma 3 GGUF was expected"
            )
        types = np.asarray(types, dtype=np.int32)
        backend = _load_backend(gf, pieces, types, progress)
        bos = int(meta.get("tokenizer.ggml.bos_token_id", 2))
        return cls(backend, pieces, types, bos, int(meta.get("tokenizer.ggml.eos_token_id", 1)))

    @property
    def vocab_size(self) -> int:
        return len(self._text)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; control pieces written in it (e.g. <end_of_turn>) become their ids.

        Raw completions keep this: their client owns the whole prompt, template included.
        """
        with self._lock:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with control pieces read as plain text: `<end_of_turn>` written in
        a message is the characters `<`, `end`, ..., never the control id (no BOS).

        The one backend is switched to that mode for the call, under the lock `encode` takes
        too, rather than kept as a second backend: copying one (`from_str(to_str())`) rebuilds
        the 262k-token vocabulary while holding the GIL, so the first chat request of a
        daemon's life would stall every thread, the engine's included, for seconds."""
        with self._lock:
            self._backend.encode_special_tokens = True
            try:
                return self._backend.encode(text, add_special_tokens=False).ids
            finally:
                self._backend.encode_special_tokens = False

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """BOS + the chat template's ids, where only the template inserts control tokens
        (engine.model.chat.chat_segments); message text is encoded with `encode_plain`."""
        ids = [self.bos_id]
        for text, template in chat_segments(messages, add_generation_prompt):
            ids += self.encode(text, add_bos=False) if template else self.encode_plain(text)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 from byte pieces becomes U+FFFD."""
        ids = [self._checked(t) for t in ids]
        byte = self._byte
        if all(byte[i] < 0 for i in ids):  # no byte pieces: each id's text, as IncrementalDecoder joins it
            text, special = self._text, self._special
            return "".join([text[i] for i in ids if not (skip_special and special[i])])
        decoder = IncrementalDecoder(self, skip_special)
        return decoder.push(ids) + decoder.flush()

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return apply_chat_template(messages, add_generation_prompt)

    def piece(self, token_id: int) -> str:
        """The vocabulary's text of one id, a control piece's too (`<bos>`, `<eos>`)."""
        return self._text[self._checked(token_id)]

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as constrained decoding (engine/grammar.py) matches them: a byte piece
        its byte; a control piece, or a user-defined one written like one (<unused0>, <img>),
        0xff then its name, which no text produces; any other its text."""
        return [bytes((b,)) if b >= 0 else (b"\xff" + t.encode()) if m else t.encode()
                for b, t, m in zip(self._byte, self._text, self._marked)]

    def _checked(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._text):
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {len(self._text)})")
        return int(token_id)


class IncrementalDecoder:
    """Streaming detokenizer: `push` returns only newly completed text.

    Bytes of a character split over byte-fallback pieces are held back until
    the character is complete; `"".join(pushes) + flush()` == `decode(all ids)`.

    >>> dec = IncrementalDecoder(tok)                     # doctest: +SKIP
    >>> dec.push([236743, 464]), dec.push([406, 378])     # doctest: +SKIP
    (' ', '⨌')
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, ids: Iterable[int]) -> str:
        tok, out = self._tok, []
        for token_id in ids:
            i = tok._checked(token_id)
            byte = tok._byte[i]
            if byte >= 0:
                out.append(self._utf8.decode(bytes((byte,))))
            elif not (self._skip and tok._special[i]):
                out.append(self.flush())
                out.append(tok._text[i])
        return "".join(out)

    def flush(self) -> str:
        """Text still held back (an unfinished character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
