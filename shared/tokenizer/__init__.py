"""Tokenization for FluidPD: Tokenizer (encode/decode/chat template/digest) and streaming
detokenization. Importing this package never imports torch or shared.engine."""

from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
