"""Integer ranges the engine wire protocols can carry (uint32 token ids and counts, int32 `top_k` and
seeds). A request value outside them is a 400 naming the field, never a failure while the engine request
is built."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

INT32_MAX = 2**31 - 1

#: A token id as a request may name one (`stop_token_ids`); the engine checks it against its vocabulary.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
#: -1 (or 0) disables top-k.
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
#: vLLM's wire carries an int32 seed.
Seed = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
TokenCount = Annotated[int, Field(ge=0, le=INT32_MAX)]
