"""Models named by Hugging Face repo id, fetched by ``huggingface_hub`` from a local stand-in of the hub.

The stand-in (swarm/testing/hub_standin.py) serves a real-layout LLaDA checkpoint, one shard per block, under the hub's
file URLs on 127.0.0.1 and counts the bytes it sends, so each test says exactly what a role downloaded.
In-process tests point ``huggingface_hub``'s constants (read from the environment at import) at the stand-in and
a fresh cache; subprocesses get the same through ``HF_ENDPOINT`` / ``HF_HOME`` / ``HF_HUB_OFFLINE``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import save_file

from swarm.models.checkpoint import INDEX_FILE
from swarm.models.hub import HubName, ModelFetchError
from swarm.models.loading import ModelFiles, resolve_model_path
from swarm.models.published import LLADA_CONFIG, llada_shapes
from swarm.testing.hub_standin import HubStandin, commit_id
from tests.test_formats import random_tensors, save_llada_tokenizer

ROOT = Path(__file__).resolve().parent.parent
REPO = "org/llada-tiny"
NUM_BLOCKS = 4
CONFIG = dict(LLADA_CONFIG, n_layers=NUM_BLOCKS)
EMBEDDING, HEAD = "model.transformer.wte.weight", ("model.transformer.ln_f.weight", "model.transformer.ff_out.weight")
SMALL_FILES = {"config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json"}  # at least these


# ----- a published-layout checkpoint, sharded as the real ones are ------------------------------------------
def shard_group(name: str) -> int:
    """Shard 0 holds the embedding, shard 1+i block i, the last shard the final norm and output head."""
    if name == EMBEDDING:
        return 0
    if ".blocks." in name:
        return 1 + int(name.split(".blocks.")[1].split(".")[0])
    return NUM_BLOCKS + 1


def write_sharded_llada(directory: Path, seed: int) -> Path:
    """``config.json``, tokenizer files, ``model-0000K-of-0000N.safetensors`` and the index, as on the hub."""
    directory.mkdir(parents=True, exist_ok=True)
    save_llada_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    tensors = random_tensors(llada_shapes(CONFIG), seed=seed)
    count = NUM_BLOCKS + 2
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        shards.setdefault(f"model-{shard_group(name) + 1:05d}-of-{count:05d}.safetensors", {})[name] = tensor
    for file_name, shard in shards.items():
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
    weight_map = {name: file for file, shard in shards.items() for name in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return directory


def shards_of(directory: Path, prefixes: tuple[str, ...]) -> set[str]:
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    return {file for name, file in weight_map.items() if name.startswith(prefixes)}


def small_files(directory: Path) -> set[str]:
    """Config, index and tokenizer files: what every role fetches when it names the model."""
    return {path.name for path in directory.iterdir() if not path.name.endswith(".safetensors")}


def blocks(start: int, end: int) -> tuple[str, ...]:
    return tuple(f"model.transformer.blocks.{i}." for i in range(start, end))


# ----- fixtures: one stand-in per module, a fresh cache per test --------------------------------------------
@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    return {"main": write_sharded_llada(root / "main", seed=1), "v2": write_sharded_llada(root / "v2", seed=2)}


@pytest.fixture(scope="module")
def hub(published):
    with HubStandin() as standin:
        standin.add_repo(REPO, published["main"])
        standin.add_repo(REPO, published["v2"], ref="v2")
        standin.add_repo("org/gated", published["main"], gated=True)
        yield standin


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch) -> dict[str, str]:
    """This process's huggingface_hub pointed at the stand-in and an empty cache; the same as environment
    variables for subprocesses (which read them at import, as users' processes do)."""
    home = tmp_path / "hf_home"
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.reset_counts()
    return env


def cached_files(env: dict[str, str]) -> set[str]:
    """File names in the cache's snapshots (what is on this machine's disk)."""
    snapshots = Path(env["HF_HUB_CACHE"]).glob("models--*/snapshots/*/*")
    return {path.name for path in snapshots if path.is_file()}


def weight_files(names) -> set[str]:
    return {name for name in names if name.endswith(".safetensors")}


# ----- naming ----------------------------------------------------------------------------------------------
def test_names_that_are_repo_ids_and_names_that_are_not():
    assert HubName.parse("GSAI-ML/LLaDA-8B-Instruct") == HubName("GSAI-ML/LLaDA-8B-Instruct", "main")
    assert HubName.parse("org/model@v1.0") == HubName("org/model", "v1.0")
    assert HubName.parse("org/model@refs/pr/1") == HubName("org/model", "refs/pr/1")
    for not_an_id in ("default", "/abs/dir", "./org/model", "a/b/c", "org/model@", "a/../b", "org--x/model"):
        assert HubName.parse(not_an_id) is None, not_an_id


def test_a_name_that_is_nothing_keeps_the_clear_error(hub_env):
    with pytest.raises(FileNotFoundError, match="is no embedded model .* neither a checkpoint directory nor a "
                                                "Hugging Face repo id"):
        resolve_model_path("./no/such/dir")


# ----- (a) a server downloads only its blocks' shards --------------------------------------------------------
def test_server_span_downloads_only_the_shards_of_its_blocks(hub, hub_env, published):
    files = ModelFiles(REPO)
    assert weight_files(hub.bytes_served()) == set(), "naming the model fetches config and tokenizer, no weights"
    span = files.span(0, 2)

    wanted = shards_of(published["main"], blocks(0, 2))
    served = hub.bytes_served(REPO)
    assert weight_files(served) == wanted and len(wanted) == 2
    assert all(served[f] == (published["main"] / f).stat().st_size for f in wanted), "each shard sent once, whole"
    assert set(served) - wanted == small_files(published["main"]), "and every small file, once"
    assert weight_files(cached_files(hub_env)) == wanted, "no other block's shard is on disk"
    # the span loaded from a directory lacking other blocks' shards holds the published weights
    expected = ModelFiles(published["main"]).span(0, 2).state_dict()
    assert all(torch.equal(span.state_dict()[k], v) for k, v in expected.items())
    assert files.path.name == "llada-tiny", "the DHT prefix is the model's name, as for a local copy"


def test_server_with_the_head_also_fetches_the_head_shard_only(hub, hub_env, published):
    files = ModelFiles(REPO)
    files.span(2, 4)
    files.head()
    wanted = shards_of(published["main"], blocks(2, 4) + HEAD)
    assert weight_files(hub.bytes_served()) == wanted
    assert shards_of(published["main"], (EMBEDDING,)) & wanted == set()


def test_a_repo_with_one_unsharded_file_in_the_native_format(hub, hub_env, tiny_model_path):
    hub.add_repo("org/tiny-native", tiny_model_path)  # config.json + model.safetensors, no index, byte tokenizer
    span = ModelFiles("org/tiny-native").span(1, 3)
    assert set(hub.bytes_served("org/tiny-native")) == {"config.json", "model.safetensors"}
    expected = ModelFiles(tiny_model_path).span(1, 3).state_dict()
    assert all(torch.equal(span.state_dict()[k], v) for k, v in expected.items())


# ----- (b) a client fetches config, tokenizer and the embedding ---------------------------------------------
def test_client_role_fetches_config_tokenizer_and_embedding_only(hub, hub_env, published):
    files = ModelFiles(REPO)
    files.tokenizer().encode("the cat sat")
    files.embedding()
    embedding_shard = shards_of(published["main"], (EMBEDDING,))
    assert weight_files(hub.bytes_served()) == embedding_shard
    assert SMALL_FILES <= set(hub.bytes_served())
    files.head()  # a client scoring itself (no head server) fetches the head's shard then, not before
    assert weight_files(hub.bytes_served()) == embedding_shard | shards_of(published["main"], HEAD)


def test_the_local_model_fetches_every_shard_and_gives_the_copys_tokens(hub, hub_env, published):
    from swarm.frontend.local import DiffusionLM

    settings = dict(gen_length=8, steps=8, block_length=8, seed=5)
    from_hub = DiffusionLM.from_pretrained(REPO).generate("once upon a time", **settings)
    assert from_hub.token_ids == DiffusionLM.from_pretrained(published["main"]).generate("once upon a time",
                                                                                         **settings).token_ids
    assert weight_files(hub.bytes_served()) == {path.name for path in published["main"].glob("*.safetensors")}


# ----- (c) revisions and the one-line errors ------------------------------------------------------------------
def test_a_revision_is_fetched_as_named(hub, hub_env, published):
    def embedding(name) -> torch.Tensor:
        return ModelFiles(name).embedding().state_dict()["embed.weight"]

    v2 = embedding(f"{REPO}@v2")
    assert torch.equal(v2, embedding(published["v2"]))
    assert not torch.equal(v2, embedding(REPO))
    commits = {path.name for path in Path(hub_env["HF_HUB_CACHE"]).glob("models--*/snapshots/*")}
    assert commits == {commit_id(REPO, "v2"), commit_id(REPO, "main")}, "each revision its own snapshot"


@pytest.mark.parametrize("name, message", [
    (f"{REPO}@no-such-branch", f"model {REPO} has no revision 'no-such-branch'"),
    ("org/no-such-model", "model 'org/no-such-model' is neither a directory here nor a repository on http"),
    ("org/gated", "model org/gated is gated: accept its terms at http"),
])
def test_missing_revision_repo_and_gated_repo_are_one_line_errors(hub_env, name, message):
    with pytest.raises(ModelFetchError) as caught:
        ModelFiles(name)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)
    assert weight_files(cached_files(hub_env)) == set()


def test_a_shard_missing_from_the_repo_is_a_clear_error(hub, hub_env, published, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in published["main"].iterdir():
        if path.name != "model-00002-of-00006.safetensors":  # block 0's shard, still in the index
            (broken / path.name).symlink_to(path)
    hub.add_repo("org/broken", broken)
    files = ModelFiles("org/broken")
    files.span(1, 2)
    with pytest.raises(ModelFetchError, match="model org/broken has no file 'model-00002-of-00006.safetensors'"):
        files.span(0, 1)


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs, too small for the shards: a real ENOSPC (needs root and mount; skipped without)."""
    mount_point = tmp_path / "full_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount_point
    finally:  # a process of the test may still hold a file there: detach it then (freed when the last one closes)
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


@pytest.mark.filterwarnings("ignore:Not enough free disk space")  # huggingface_hub's own warning, first
def test_a_full_disk_is_a_one_line_error(hub_env, full_disk, monkeypatch):
    monkeypatch.setattr(constants, "HF_HOME", str(full_disk))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(full_disk / "hub"))
    with pytest.raises(ModelFetchError, match=f"model {REPO}: no space left on the disk of {full_disk}/hub "
                                              "while fetching model-.*safetensors: free some, or point HF_HOME"):
        ModelFiles(REPO).span(0, NUM_BLOCKS)


def test_the_cli_maps_a_fetch_error_to_one_line_and_exit_2(hub_env):
    """The server command, run in this process (pointed at the stand-in by ``hub_env``): a process of its own
    imported torch and hivemind before the fetch failed, ~3.5 CPU s."""
    from click.testing import CliRunner

    from swarm.server.__main__ import main as server_main

    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(server_main, ["--model", "org/no-such-model"], catch_exceptions=False)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert lines == ["Error: model 'org/no-such-model' is neither a directory here nor a repository on "
                     f"{hub_env['HF_ENDPOINT']} (a private repo needs `hf auth login` or HF_TOKEN)"]


def test_a_download_that_breaks_off_resumes_where_it_stopped(hub, hub_env, published, monkeypatch):
    # huggingface_hub keeps what it received in whole chunks (10 MB); this shard is 36 kB, so 4 kB chunks here
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    shard = sorted(shards_of(published["main"], blocks(1, 2)))[0]
    size = (published["main"] / shard).stat().st_size
    hub.break_once[shard] = size // 2  # 4 whole chunks arrive, then the connection drops
    span = ModelFiles(REPO).span(1, 2)
    assert hub.break_once == {}, "the connection did drop"
    # a restart would download the whole file again: resumption sends less than twice the cut
    assert size <= hub.bytes_served()[shard] < size + size // 2
    expected = ModelFiles(published["main"]).span(1, 2).state_dict()
    assert all(torch.equal(span.state_dict()[k], v) for k, v in expected.items())


# ----- (d) offline mode: the cache only ---------------------------------------------------------------------
OFFLINE_PROBE = """
import sys
from swarm.models.hub import ModelFetchError
from swarm.models.loading import ModelFiles
files = ModelFiles(sys.argv[1])
files.span(0, 2)
print("SPAN 0:2 OK")
try:
    files.span(2, 3)
except ModelFetchError as error:
    print("ERROR", error)
"""


def test_offline_works_from_the_cache_and_names_what_is_missing(hub, hub_env, published):
    ModelFiles(REPO).span(0, 2)  # online, once
    hub.reset_counts()
    env = dict(os.environ, **hub_env, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", OFFLINE_PROBE, REPO], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "SPAN 0:2 OK" in result.stdout
    missing = sorted(shards_of(published["main"], blocks(2, 3)))[0]
    assert f"ERROR model {REPO}: {missing} is not in the Hugging Face cache" in result.stdout
    assert "HF_HUB_OFFLINE is set" in result.stdout
    assert hub.served == [], "offline, nothing is asked of the hub"


# ----- (e) end to end: a server from an empty cache, generation through it -----------------------------------
def test_server_from_repo_id_with_empty_cache_generates_the_local_models_tokens(hub, hub_env, published, tmp_path,
                                                                              local_swarm):
    """The server runs with the volunteer's environment (its own cache), so it is not forked from the shared swarm's
    fork server; it joins the shared swarm's bootstrap peer (its model, ``llada-tiny``, is a prefix of its own): a
    swarm of its own cost a fork server and a bootstrap peer, ~3.4 CPU s, for this one server."""
    from swarm.client import DistributedDiffusionLM
    from swarm.frontend.local import DiffusionLM
    from swarm.utils.local_swarm import LocalSwarm

    server_home = tmp_path / "server_hf_home"  # the volunteer's machine: its own, empty cache
    server_env = dict(hub_env, HF_HOME=str(server_home), HF_HUB_CACHE=str(server_home / "hub"))
    settings = dict(gen_length=8, steps=8, block_length=8, seed=3)
    expected = DiffusionLM.from_pretrained(published["main"]).generate("the cat sat on the mat", **settings)
    joining = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    with LocalSwarm(env=server_env) as swarm:
        swarm.start_server(REPO, f"0:{NUM_BLOCKS}", "--compute-threads", "1", *joining)
        # spot checks off: a checked hop (5% by default, by chance) fetches the blocks to recompute it, and this test
        # counts the shards the client downloads (a shuffled run drew one)
        lm = DistributedDiffusionLM.from_pretrained(REPO, initial_peers=local_swarm.initial_peers, request_timeout=30,
                                                    spot_check_fraction=0)
        try:
            result = lm.generate("the cat sat on the mat", **settings)
        finally:
            lm.shutdown()
    assert result.token_ids == expected.token_ids
    assert lm.prefix == "llada-tiny"
    main = published["main"]
    assert weight_files(cached_files(server_env)) == shards_of(main, blocks(0, NUM_BLOCKS)), "server: its blocks"
    client_shards = weight_files(cached_files(hub_env))
    assert shards_of(main, (EMBEDDING,)) <= client_shards and not client_shards & shards_of(main, blocks(0, 1))
