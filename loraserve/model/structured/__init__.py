"""Structured outputs: per-request grammars (llguidance) and the batch's token mask."""

from loraserve.model.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarError
from loraserve.model.structured.mask import GrammarMasker, PendingMask

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarMasker", "PendingMask"]
