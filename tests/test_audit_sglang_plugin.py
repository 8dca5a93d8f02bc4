"""The `--dflash2-config` flag's rewriting under misuse (no sglang needed): a user's
`--hicache-storage-backend-extra-config` that is not a JSON object is refused with an error naming
the flag, not a bare JSONDecodeError or AttributeError from inside sglang's argument hook."""

from __future__ import annotations

import pytest

from dflash2.client.sglang.plugin import backend_extra_config


@pytest.mark.parametrize("user_extra, problem", [
    ("prefetch_threshold=256", "is not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('"file"', "must be a JSON object"),
])
def test_extra_config_that_is_not_a_json_object_names_the_flag(user_extra, problem):
    with pytest.raises(ValueError, match=f"--hicache-storage-backend-extra-config {problem}"):
        backend_extra_config("c.json", user_extra)
