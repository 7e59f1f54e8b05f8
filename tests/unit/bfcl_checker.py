"""BFCL's own AST checker and output decoders over JSON lines (run by tests/unit/test_bfcl.py in
.venv-bfcl, built by scripts/test-bfcl-checker.sh). Each stdin line is one case, each stdout
line its answer:

- ``{"functions", "calls", "answer", "category"}``: ``ast_checker``'s verdict on decoded calls
  -> ``{"valid", "error_type"}`` (``error_type`` "" when valid);
- ``{"kind": "decode", "handler", "format", "text"}``: a raw model output as that handler of the
  leaderboard decodes it (``decode_ast`` in ``format``, "python" or "json", after the reasoning
  is cut off as BFCL's Qwen handler cuts it: the text after the last ``</think>``) -> ``{"calls"}``,
  or ``{"error"}`` (the exception's type) when it does not decode.
"""

import json
import os
import sys
import tempfile
import types

# bfcl-eval makes result/, score/ and .file_locks/ under its project root when imported
os.environ.setdefault("BFCL_PROJECT_ROOT", tempfile.mkdtemp(prefix="bfcl-root-"))

from bfcl_eval.constants.enums import Language, ReturnFormat  # noqa: E402
from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker  # noqa: E402
from bfcl_eval.model_handler.local_inference.bitagent import BitAgentHandler  # noqa: E402
from bfcl_eval.model_handler.local_inference.hammer import HammerHandler  # noqa: E402
from bfcl_eval.model_handler.local_inference.llama_3_1 import LlamaHandler_3_1  # noqa: E402
from bfcl_eval.model_handler.local_inference.phi import PhiHandler  # noqa: E402
from bfcl_eval.model_handler.local_inference.qwen import QwenHandler  # noqa: E402
from bfcl_eval.model_handler.local_inference.qwen_fc import QwenFCHandler  # noqa: E402

# a model of the leaderboard whose function names keep their dots (underscore_to_dot False)
MODEL = "Qwen_Qwen3-8B"
# handlers made without their __init__ (which sets up a client): decode_ast uses no state
HANDLERS = {name: object.__new__(cls) for name, cls in {
    "qwen": QwenHandler, "phi": PhiHandler, "bitagent": BitAgentHandler, "hammer": HammerHandler,
    "llama_3_1": LlamaHandler_3_1, "qwen_fc": QwenFCHandler}.items()}
FORMATS = {"python": ReturnFormat.PYTHON, "json": ReturnFormat.JSON}


def response(text):
    """The model's response as BFCL's Qwen (prompting) handler parses a completion."""
    reply = types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)],
                                  usage=types.SimpleNamespace(prompt_tokens=0, completion_tokens=0))
    return HANDLERS["qwen"]._parse_query_response_prompting(reply)["model_responses"]


def decode(case):
    try:
        calls = HANDLERS[case["handler"]].decode_ast(response(case["text"]), FORMATS[case["format"]], False)
    except Exception as err:  # noqa: BLE001 - any failure is BFCL's "could not decode"
        return {"error": type(err).__name__}
    return {"calls": json.loads(json.dumps(calls, default=repr))}


for line in sys.stdin:
    case = json.loads(line)
    if case.get("kind") == "decode":
        answer = decode(case)
    else:
        verdict = ast_checker(case["functions"], case["calls"], case["answer"], Language.PYTHON,
                              case["category"], MODEL)
        valid = bool(verdict["valid"])
        answer = {"valid": valid, "error_type": "" if valid else verdict["error_type"]}
    sys.stdout.write(json.dumps(answer) + "\n")
