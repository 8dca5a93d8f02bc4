"""LoRA adapters through sglang's own page keys (sglang 0.5.23): pages are shared only between
servers whose model computes the same KV (README "sglang", "The model's identity"). A LoRA adapter
changes the KV its requests compute (LoRA on k_proj / v_proj), and sglang keys an adapter's pages
by `extra_key` = its lora_id, which for `--lora-paths NAME=PATH` is uuid5(NAME, PATH): the path as
typed, unresolved, never the adapter's files. The page namespace (identity.py IDENTITY_ARGS) does
not cover the adapters either. So two servers of one base model whose adapter NAME=PATH names other
weights (a fine-tune replaced at the same path; a relative path from another working directory, or
another container's mount) read each other's adapter KV as hits: wrong KV, no error (a review). The
namespace covers each adapter's files now (identity.lora_adapters)."""

from __future__ import annotations

import argparse
import json

import pytest

try:
    import torch  # noqa: F401
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed
except Exception as exc:
    pytest.skip(f"sglang is not importable here ({exc})", allow_module_level=True)

from dflash2.client.sglang.identity import server_args
from dflash2.client.sglang.plugin import backend_extra_config
from test_sglang import backends, daemon  # noqa: F401  (fixtures)
from test_sglang import PAGE, fill, host_pool, indices, storage_config


def server(config_path, model_dir, lora_paths):
    """One sglang server's backend, as the flag sets it up (its server arguments -> dflash2_model)."""
    args = argparse.Namespace(model_path=str(model_dir), lora_paths=lora_paths)
    config = storage_config(config_path)
    config.model_name = str(model_dir)
    config.extra_config = {**json.loads(backend_extra_config(config_path, None, model=server_args(args))),
                           "dflash2_timeout_s": 1.0}
    pool = host_pool()
    b = StorageBackendFactory.create_backend("dynamic", config, pool)
    b.register_mem_pool_host(pool)
    return b, pool


def adapter_page_key(name, path, tokens):
    """sglang's storage key of the first page of `tokens` in a request for adapter NAME=PATH
    (lora_hook: lora_id = deterministic_id(name, path); schedule_batch: extra_key += lora_id;
    get_storage_hash_str seeds the chain with storage_namespace_seed(extra_key, cache_salt))."""
    lora_id = LoRARef.deterministic_id(name, path)
    return get_hash_str(tokens[:PAGE], storage_namespace_seed(lora_id, None))


def test_servers_whose_adapter_has_other_weights_share_no_adapter_pages(daemon, tmp_path, backends):
    path, _ = daemon
    model = tmp_path / "llama3-8b"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"base weights")
    adapter = tmp_path / "adapters" / "support"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 8, "target_modules": ["k_proj", "v_proj"]}')
    (adapter / "adapter_model.safetensors").write_bytes(b"fine-tune v1")
    tokens = list(range(100, 100 + PAGE))

    a, pool_a = server(path, model, [f"support={adapter}"])
    backends.append(a)
    key = adapter_page_key("support", str(adapter), tokens)
    fill(pool_a, [1], seed=1)  # the KV of `tokens` under adapter v1
    assert a.batch_set_v1([key], indices([1])) == [True]

    # The adapter is retrained and put in place under the same path; a new server starts.
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").write_bytes(b"fine-tune v2 -- other weights")
    b, pool_b = server(path, model, [f"support={adapter}"])
    backends.append(b)
    key_b = adapter_page_key("support", str(adapter), tokens)
    hits = b.batch_exists([key_b])
    got = b.batch_get_v1([key_b], indices([2]))
    assert b.keys.namespace != a.keys.namespace
    assert hits == 0 and got == [False], "the v2 adapter's server read the v1 adapter's KV as a hit"
