"""Evaluation protocols (docs/evaluation.md): a registry of objects, each owning its parameters and its windows.

A perplexity protocol turns held-out documents and an evaluation length L into windows of L + 1 tokens (inputs +
shifted targets) and says which targets of each window are scored. Windows never cross a document and are
never padded: a length no document can fill gives no window, and ``missing`` says why. Key-token perplexity
scores the targets a longer context helps (two passes); the haystack protocols write needles into the held-out
text and score retrieval (lenext.haystack).

A protocol is a module of this package, registered in ``PROTOCOLS`` below (docs/adding/protocol.md).
"""

from lenext.protocols.answers import ACCURACY, Answers
from lenext.protocols.base import TextProtocol, Window, cap_windows, metric_range, registry
from lenext.protocols.haystack import (
    Haystack,
    NeedleMultiKey,
    NeedleMultiQuery,
    NeedleMultiValue,
    NeedleSingle,
    VariableTracking,
)
from lenext.protocols.key_tokens import KeyTokens, evaluator_net, refuse_an_evaluator_of_other_text
from lenext.protocols.last_k import LastK
from lenext.protocols.nonoverlap import NonOverlapping
from lenext.protocols.sliding import Sliding

PROTOCOLS: dict[str, type[TextProtocol]] = registry(
    NonOverlapping,
    Sliding,
    LastK,
    KeyTokens,
    NeedleSingle,
    NeedleMultiKey,
    NeedleMultiValue,
    NeedleMultiQuery,
    VariableTracking,
)
PROTOCOL_NAMES = (*PROTOCOLS, ACCURACY)
METRICS_OF = {name: protocol.metrics for name, protocol in (*PROTOCOLS.items(), (ACCURACY, Answers))}


__all__ = [
    "ACCURACY",
    "METRICS_OF",
    "PROTOCOLS",
    "PROTOCOL_NAMES",
    "Answers",
    "Haystack",
    "KeyTokens",
    "LastK",
    "NeedleMultiKey",
    "NeedleMultiQuery",
    "NeedleMultiValue",
    "NeedleSingle",
    "NonOverlapping",
    "Sliding",
    "TextProtocol",
    "VariableTracking",
    "Window",
    "cap_windows",
    "evaluator_net",
    "metric_range",
    "refuse_an_evaluator_of_other_text",
]
