"""The request front (front.py `RequestFront`): the one way both doors reach the runner. Beside it, what a call
goes through on its way in: `GenerateParams` (generate_params.py, either door's request before any check),
`Preparer` (prepare.py: tokenizing, every limit, the grammar compile, the adapter check), the chat template
(chat_template.py) and adapter loading (adapter_management.py). The operator's limits (service/limits.py) and the
balancer's wire names (service/affinity.py) stay at the service's root: the runner and the torch-free SDK read
them too.

The doors import the front's names, and the runner's types they read, from here."""
from __future__ import annotations

from service.front.front import RequestFront
from service.front.generate_params import FieldNames, GenerateParams
from service.runner.detokenizer import TokenText
from service.runner.parent_request import ParentRequest
from service.runner.request import GenerationRequest, ModelInfo, RequestOutput

__all__ = ["FieldNames", "GenerateParams", "GenerationRequest", "ModelInfo", "ParentRequest", "RequestFront",
           "RequestOutput", "TokenText"]
