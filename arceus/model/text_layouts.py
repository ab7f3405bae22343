"""What a model that writes text (a GPT, a Llama) takes and hands on at its stage boundaries: token ids into the
embedding, hidden states of `width` between layers, logits out, the next token as labels; its blocks (every layer
between the embedding and the head) are what a tensor-parallel group splits."""

from __future__ import annotations

from arceus.model.layout import TensorLayout


class TextDecoderLayouts:
    """Mixed into a text model's spec, which provides `block_size`, `vocab_size`, `num_layers` and `width`."""

    block_size: int
    vocab_size: int
    num_layers: int
    width: int  # the hidden state's size per token
    tie_word_embeddings: bool  # the LM head is the token embedding (arceus.model.tied)
    embedding_weight: str  # the token embedding's name in layer 0

    def input_layout(self, layer: int) -> TensorLayout:
        if layer == 0:
            return TensorLayout("int64", (self.block_size,), bound=self.vocab_size)
        return self._hidden()

    def output_layout(self, layer: int) -> TensorLayout:
        if layer == self.num_layers - 1:
            return TensorLayout("float32", (self.block_size, self.vocab_size))  # logits
        return self._hidden()

    def label_layout(self) -> TensorLayout:
        """The next token at every position."""
        return TensorLayout("int64", (self.block_size,), bound=self.vocab_size)

    def split_layers(self) -> frozenset[int]:
        """The blocks between the embedding and the head: a tensor-parallel group splits their heads and MLP units."""
        return frozenset(range(1, self.num_layers - 1))

    def tied_parameters(self) -> tuple[tuple[str, ...], ...]:
        """With `tie_word_embeddings`, the LM head's weight is the token embedding's."""
        if not self.tie_word_embeddings:
            return ()
        return ((f"layers.0.{self.embedding_weight}", f"layers.{self.num_layers - 1}.lm_head.weight"),)

    def _hidden(self) -> TensorLayout:
        return TensorLayout("float32", (self.block_size, self.width))
