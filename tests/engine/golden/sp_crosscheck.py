"""A second, independent tokenizer for the golden prompts: the GGUF's
vocabulary rebuilt as a SentencePiece BPE model (the format Gemma's tokenizer
was trained in) and run by the `sentencepiece` library.

transformers' GGUF tokenizer conversion is known to be inexact in places
(runs of 32+ spaces), so make_golden.py requires both tokenizers to agree on
every prompt before it records the prompt ids.
"""

from __future__ import annotations

import re

import sentencepiece as spm
from gguf import GGUFReader
from sentencepiece import sentencepiece_model_pb2 as pb

_PIECE = pb.ModelProto.SentencePiece
# GGUF token types (llama.cpp numbering) -> SentencePiece piece types.
_TYPES = {1: _PIECE.NORMAL, 2: _PIECE.UNKNOWN, 3: _PIECE.CONTROL,
          4: _PIECE.USER_DEFINED, 5: _PIECE.UNUSED, 6: _PIECE.BYTE}
# Control tokens that may be written literally in a golden prompt.
_CONTROL_RE = re.compile(r"(<bos>|<eos>|<start_of_turn>|<end_of_turn>)")


class SentencePieceCrossCheck:
    """Encodes text like the engine must: control tokens written literally map
    to their ids, the text between them goes through SentencePiece."""

    def __init__(self, gguf_path: str) -> None:
        fields = GGUFReader(gguf_path).fields
        tokens = fields["tokenizer.ggml.tokens"].contents()
        types = fields["tokenizer.ggml.token_type"].contents()
        scores = fields["tokenizer.ggml.scores"].contents()
        unk = int(fields["tokenizer.ggml.unknown_token_id"].contents())
        self._bos = int(fields["tokenizer.ggml.bos_token_id"].contents())

        model = pb.ModelProto()
        spec = model.trainer_spec
        spec.model_type = pb.TrainerSpec.BPE
        spec.vocab_size = len(tokens)
        spec.byte_fallback = True
        spec.unk_id = unk
        spec.bos_id = self._bos
        spec.eos_id = int(fields["tokenizer.ggml.eos_token_id"].contents())
        spec.pad_id = int(fields["tokenizer.ggml.padding_token_id"].contents())
        norm = model.normalizer_spec
        norm.name = "identity"  # Gemma: no NFKC, no dummy prefix, keep spaces
        norm.add_dummy_prefix = False
        norm.remove_extra_whitespaces = False
        norm.escape_whitespaces = True
        for i, (piece, kind, score) in enumerate(zip(tokens, types, scores)):
            entry = model.pieces.add()
            # The file stores the space-run user tokens with real spaces;
            # SentencePiece spells a space as U+2581.
            entry.piece = piece.replace(" ", "\u2581")
            entry.score = float(score)
            entry.type = _PIECE.UNKNOWN if i == unk else _TYPES[int(kind)]
        self._sp = spm.SentencePieceProcessor(model_proto=model.SerializeToString())
        self._control = {t: i for i, t in enumerate(tokens) if _CONTROL_RE.fullmatch(t)}

    def encode(self, text: str, add_bos: bool) -> list[int]:
        """Token ids of ``text``, with BOS (id 2) first when ``add_bos``."""
        ids = [self._bos] if add_bos else []
        for part in _CONTROL_RE.split(text):
            if part in self._control:
                ids.append(self._control[part])
            elif part:
                ids.extend(self._sp.encode(part))
        return ids
