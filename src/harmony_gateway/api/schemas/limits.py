"""Integer ranges the engine wire protocols can carry (uint32 token ids and counts, int32 `top_k`) and the
64-bit seeds clients send. A request value outside them is a 400 naming the field, never a failure while
the engine request is built."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

INT32_MAX = 2**31 - 1

#: A token id as a request may name one (`stop_token_ids`); the engine checks it against its vocabulary.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
#: -1 (or 0) disables top-k.
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
#: Any 64-bit seed, as OpenAI accepts; an engine module folds it into the width its wire carries.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenCount = Annotated[int, Field(ge=0, le=INT32_MAX)]
