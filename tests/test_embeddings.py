"""Embeddings: a prompt's final hidden state pooled into one vector (``Request.embed``), as
one forward pass of mlx-lm's model body over the whole prompt gives it, whatever the
prefill chunks; and ``/v1/embeddings`` and Ollama's ``/api/embed`` on a real server."""

from __future__ import annotations

import math

import pytest

from mlxkv.engine.events import Embedding, Failed, Finished, TokenDelta
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.engine.session import GenerationSettings
from mlxkv.policy import KVPolicy
from tests.serve_helpers import serving

pytestmark = pytest.mark.model

TEXT = "The capital of France is Paris. The capital of Italy is Rome."


def reference(loaded, ids: list[int]):
    """mlx-lm's model body over the whole prompt at once: (its last hidden state, their
    mean), in float32."""
    import mlx.core as mx

    h = loaded.model.model(mx.array(ids)[None])[0].astype(mx.float32)
    return h[-1].tolist(), h.mean(axis=0).tolist()


@pytest.mark.parametrize("step", [512, 5])  # one chunk, and chunks of 5 tokens
def test_a_prompt_is_pooled_as_one_forward_pass(default_model, step):
    """Last-token and mean pooling, in chunks or not, are the whole prompt's in one pass;
    an answer asked beside them is unchanged, and the pooled prompts answer nothing."""
    ids = Scheduler(default_model).encode(TEXT)
    last, mean = reference(default_model, ids)
    settings = GenerationSettings(max_tokens=4, prefill_step=step)
    sched = Scheduler(default_model, KVPolicy(), max_batch=2)
    plain = sched.submit(Request(ids, settings))
    pooled = {how: sched.submit(Request(ids, settings, embed=how)) for how in ("last", "mean")}
    alone = Scheduler(default_model, KVPolicy()).submit(Request(ids, settings))
    while sched.step():
        pass
    for how, want in (("last", last), ("mean", mean)):
        events = list(pooled[how].events())
        assert [type(e) for e in events if not type(e).__name__ == "PrefillProgress"] == [
            Embedding,
            Finished,
        ]
        (e,) = [e for e in events if isinstance(e, Embedding)]
        assert len(e.vector) == default_model.config["hidden_size"] == 576
        assert e.vector == pytest.approx(want, abs=1e-4)  # float32 sums in other orders
        done = events[-1]
        assert done.finish_reason == "stop" and done.text == ""
        assert done.stats.prompt_tokens == len(ids) and done.stats.prompt_tokens_cached == 0
        assert done.stats.generation_tokens == 0
    while alone._scheduler.step():
        pass
    text = [e.text for e in plain.events() if isinstance(e, TokenDelta)]
    assert text and text == [e.text for e in alone.events() if isinstance(e, TokenDelta)]


def _spy_body_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes of each call of the model's body, which the real model still runs."""
    import mlxkv.models.head as head

    shapes, real = [], head.hidden_states

    def counted(model, inputs, cache):
        shapes.append(tuple(inputs.shape))
        return real(model, inputs, cache)

    monkeypatch.setattr(head, "hidden_states", counted)
    return shapes


def _pooled(sched, handles) -> list[list[float]]:
    while sched.step():
        pass
    out = []
    for h in handles:
        events = list(h.events())
        assert isinstance(events[-1], Finished), events[-1]
        out.append(next(e.vector for e in events if isinstance(e, Embedding)))
    return out


def test_short_inputs_share_one_model_call_and_pool_as_each_alone(default_model, monkeypatch):
    """Inputs that one prompt chunk takes go through the model together, right-padded,
    those nearest in length first, as many as keep rows x longest within the prefill step
    and the padding within a quarter of it; each row's vector is its input's own in a pass
    alone (last-token or mean, mixed in one call)."""
    texts = ["Paris.", "The capital of Italy is Rome.", "Hi", TEXT, "Snow is white."]
    probe = Scheduler(default_model)
    inputs = [probe.encode(t) for t in texts]
    lengths = [len(ids) for ids in inputs]
    assert lengths == [2, 7, 1, 14, 4]
    shapes = _spy_body_calls(monkeypatch)
    sched = Scheduler(default_model, KVPolicy(), max_batch=8)
    settings = GenerationSettings(max_tokens=1, prefill_step=32)
    hows = ["last", "mean", "last", "mean", "mean"]
    handles = [
        sched.submit(Request(ids, settings, embed=how))
        for ids, how in zip(inputs, hows, strict=True)
    ]
    vectors = _pooled(sched, handles)
    # 2 takes 1 (1 padded of 4), not 4 (5 of 12); 7 takes 4 (3 of 14), not 14 (3 x 14 > 32)
    assert shapes == [(2, 2), (2, 7), (1, 14)]
    for ids, how, got in zip(inputs, hows, vectors, strict=True):
        last, mean = reference(default_model, ids)
        # float32 matmuls over a padded batch sum in other orders (relative 2e-6 seen)
        assert got == pytest.approx(last if how == "last" else mean, abs=1e-4)


def test_inputs_share_a_call_only_as_far_as_the_memory_budget_admits(default_model, monkeypatch):
    """With room beside the weights and runtime for two inputs' reservations, five inputs
    go through the model two, two and one at a time, and each still gets its vector."""
    from mlxkv.engine.admission import MemoryBudget

    ids = Scheduler(default_model).encode(TEXT)
    probe = MemoryBudget(default_model, None, 4, 512)
    room = probe.base() + 2 * probe.reservation(KVPolicy(), len(ids) + 1) + (1 << 10)
    sched = Scheduler(default_model, KVPolicy(), memory=MemoryBudget(default_model, room, 4, 512))
    shapes = _spy_body_calls(monkeypatch)
    one = GenerationSettings(max_tokens=1)  # as the server asks: no answer
    handles = [sched.submit(Request(ids, one, embed="last")) for _ in range(5)]
    vectors = _pooled(sched, handles)
    assert shapes == [(2, len(ids)), (2, len(ids)), (1, len(ids))]
    want = reference(default_model, ids)[0]
    assert all(v == pytest.approx(want, abs=1e-4) for v in vectors)


def test_an_embedding_does_not_wait_for_a_full_batch_to_finish(default_model):
    """With every row of the batch taken by an answer, an embedding (which never takes a
    row) still starts and ends while the answer decodes."""
    sched = Scheduler(default_model, KVPolicy(), max_batch=1)
    ids = sched.encode(TEXT)
    answer = sched.submit(Request(ids, GenerationSettings(max_tokens=24, ignore_eos=True)))
    sched.step()  # the answer takes the only row
    pooled = sched.submit(Request(ids, GenerationSettings(max_tokens=1), embed="last"))
    for _ in range(4):
        sched.step()
    assert isinstance(list(pooled.events())[-1], Finished)
    assert not answer.done
    while sched.step():
        pass
    assert list(answer.events())[-1].stats.generation_tokens == 24


def test_a_prompt_past_the_context_is_refused(default_model):
    sched = Scheduler(default_model, KVPolicy())
    limit = default_model.context_length
    h = sched.submit(Request([1] * limit, embed="last"))
    while sched.step():
        pass
    (e,) = list(h.events())
    assert isinstance(e, Failed) and e.code == "context_length_exceeded"
    assert e.message.startswith(f"the prompt has {limit} tokens but the model's context is")


# -- through the server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("serve_embed"))


def unit(v: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(x * x for x in v))
    return [x / norm for x in v]


def test_openai_embeddings_are_the_last_hidden_state_made_unit_length(server, default_model):
    """The official client (which asks for base64 and decodes it) gets, for each input in
    order, the final hidden state at its last token, made unit length; as numbers the
    same; the usage counts every input's tokens."""
    texts = [TEXT, "hello", "Paris is the capital of France."]
    want = []
    for t in texts:
        ids = default_model.tokenizer.encode(t, add_special_tokens=True)
        want.append((unit(reference(default_model, ids)[0]), len(ids)))
    client = server.client()
    r = client.embeddings.create(model=server.model, input=texts)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == server.model
    for d, (vector, _) in zip(r.data, want, strict=True):
        assert len(d.embedding) == 576 and d.embedding == pytest.approx(vector, abs=1e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(n for _, n in want)
    line = f"mlxkv: /v1/embeddings 3 embedding(s) of 576 numbers, {r.usage.prompt_tokens} tokens"
    assert f"{line}, pooling last\n" in server.log()
    as_numbers = client.embeddings.create(model=server.model, input=texts, encoding_format="float")
    for a, b in zip(r.data, as_numbers.data, strict=True):
        assert a.embedding == b.embedding  # the same float32 numbers, either way
    # one input alone, or as token ids: the same vector
    ids = default_model.tokenizer.encode(texts[1], add_special_tokens=True)
    for given in (texts[1], ids, [ids]):
        (d,) = client.embeddings.create(model=server.model, input=given).data
        assert d.embedding == pytest.approx(r.data[1].embedding, abs=1e-6)


def test_dimensions_keep_the_first_numbers_made_unit_length(server):
    body = {"model": server.model, "input": TEXT, "encoding_format": "float"}
    whole = server.http("POST", "/v1/embeddings", json=body).json()["data"][0]["embedding"]
    cut = server.http("POST", "/v1/embeddings", json={**body, "dimensions": 64}).json()
    assert cut["data"][0]["embedding"] == pytest.approx(unit(whole[:64]), abs=1e-6)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({}, "input", "input is required: a text, a list of texts or of token ids"),
        ({"input": ""}, "input", "input is empty"),
        ({"input": []}, "input", "input must be a non-empty string, list of strings or token ids"),
        ({"input": ["a", ""]}, "input", "input[1] is empty"),
        ({"input": ["a"] * 2049}, "input", "input holds 2049 inputs; at most 2048"),
        ({"input": [5, 49152]}, "input", "input[0] holds token id 49152, outside the vocabulary"),
        ({"input": [1] * 8192}, "input", "input has 8192 tokens but the model's context is 8192"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format must be"),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be in [1, 576], got 0"),
        ({"input": "a", "dimensions": 577}, "dimensions", "dimensions must be in [1, 576], got"),
        ({"input": "a", "stream": True}, "stream", "Unrecognized request argument supplied: st"),
    ],
)
def test_a_bad_embeddings_request_is_a_400_naming_the_field(server, body, param, message):
    r = server.http("POST", "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message)
    assert err["type"] == "invalid_request_error"


def test_a_client_that_leaves_stops_its_embeddings(server):
    """A client that closes its connection while its 64 inputs are embedded: the inputs
    in flight (the first 16, --max-batch) are cancelled, the others never submitted."""
    import time

    import httpx

    inputs = [f"{TEXT} Input number {i}. " * 30 for i in range(64)]  # ~500 tokens each
    before = server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/embeddings", json={"input": inputs}, timeout=1.0)
    deadline = time.monotonic() + 120
    while (now := server.status())["requests_finished"] < before["requests_finished"] + 16:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    time.sleep(1.0)  # a second window would have started by now
    now = server.wait_idle()
    assert now["requests_finished"] == before["requests_finished"] + 16
    assert now["prompt_tokens_prefilled"] - before["prompt_tokens_prefilled"] < 16 * 500
    assert "Traceback" not in server.log()


def test_another_models_name_is_a_404(server):
    body = {"model": "text-embedding-3-small", "input": "a"}
    r = server.http("POST", "/v1/embeddings", json=body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_ollama_embed_answers_the_same_unit_vectors(server):
    """Ollama's /api/embed (its tag added to the name) gives OpenAI's vectors as numbers;
    the older /api/embeddings answers the pooled state itself."""
    import ollama

    texts = [TEXT, "hello"]
    openai = server.client().embeddings.create(model=server.model, input=texts)
    client = ollama.Client(host=server.url)
    out = client.embed(model=f"{server.model}:latest", input=texts)
    assert out.model == server.model and out.prompt_eval_count == openai.usage.prompt_tokens
    for got, d in zip(out.embeddings, openai.data, strict=True):
        assert list(got) == pytest.approx(d.embedding, abs=1e-6)
    raw = list(client.embeddings(model=server.model, prompt="hello").embedding)
    assert unit(raw) == pytest.approx(openai.data[1].embedding, abs=1e-5)
    assert math.sqrt(sum(x * x for x in raw)) > 2  # not made unit length
    r = server.http("POST", "/api/embed", json={"model": server.model, "input": 5})
    assert r.status_code == 400
    assert r.json() == {"error": "input must be a text or a list of texts, got 5"}


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, default_model_path):
    """A random llama of a 64-token context, with the default model's tokenizer."""
    from tests.tiny_models import BASE, model_folder

    cfg = dict(BASE, model_type="llama", vocab_size=49152, max_position_embeddings=64)
    return model_folder(tmp_path_factory.mktemp("short"), cfg, default_model_path)


def test_an_input_past_the_context_is_cut_only_when_asked(tmp_path, short_model):
    """Ollama's truncate (its default) cuts an input to the context; OpenAI's request and
    Ollama's with truncate false are refused, naming the input."""
    long = "word " * 100
    for s in serving(tmp_path, str(short_model), "--force"):
        r = s.http("POST", "/api/embed", json={"input": ["hi", long]})
        assert r.status_code == 200 and r.json()["prompt_eval_count"] == 1 + 63
        r = s.http("POST", "/api/embed", json={"input": ["hi", long], "truncate": False})
        assert r.status_code == 400
        assert r.json()["error"] == (
            "input[1] has 101 tokens but the model's context is 64 tokens; shorten it"
        )
        huge = "word " * 5000  # more characters than 64 tokens of any of its vocabulary hold
        r = s.http("POST", "/api/embed", json={"input": huge})
        assert r.status_code == 200 and r.json()["prompt_eval_count"] == 63
        r = s.http("POST", "/api/embed", json={"input": huge, "truncate": False})
        assert r.json()["error"] == (
            "input has 25000 characters but the model's context is 64 tokens; shorten it"
        )
        r = s.http("POST", "/v1/embeddings", json={"input": long})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "input"
        assert err["code"] == "context_length_exceeded"


def test_a_model_without_readable_hidden_states_says_so(tmp_path, default_model_path):
    from tests.tiny_models import CONFIGS, model_folder

    folder = model_folder(tmp_path / "lfm2", CONFIGS["lfm2"], default_model_path)
    for s in serving(tmp_path / "serve", str(folder), "--force"):
        r = s.http("POST", "/v1/embeddings", json={"input": [1, 2, 3]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("embeddings_unsupported", "model")
        assert err["message"].startswith("this model (mlx_lm.models.lfm2) gives no final hidden")


def sentence_files(folder, modes: dict, path: str = "1_Pooling", modules=None) -> None:
    """sentence-transformers' files: modules.json naming a Pooling module at ``path``,
    and its config.json with ``modes``."""
    import json

    pooling = {"idx": 1, "name": "1", "path": path, "type": "sentence_transformers.models.Pooling"}
    given = modules if modules is not None else [pooling]
    (folder / "modules.json").write_text(json.dumps(given))
    (folder / path).mkdir(exist_ok=True)
    (folder / path / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **modes})
    )


LAST, MEAN = {"pooling_mode_lasttoken": True}, {"pooling_mode_mean_tokens": True}
NOTE = "the model's sentence-transformers pooling is "
NORMALIZE = [{"type": "sentence_transformers.models.Normalize"}]
OUTSIDE = "modules.json names a Pooling module outside the model (../up)"


@pytest.mark.parametrize(
    "modes, path, modules, want",
    [
        ({**LAST, "pooling_mode_mean_tokens": False}, None, None, ("last", None)),
        (MEAN, None, None, ("mean", None)),
        ({"pooling_mode_cls_token": True}, None, None, (None, NOTE + "pooling_mode_cls_token")),
        ({**LAST, **MEAN}, None, None, (None, NOTE + ", ".join([*LAST, *MEAN]))),
        ({}, None, None, (None, NOTE + "none")),
        (LAST, "../up", None, (None, OUTSIDE)),
        (LAST, None, NORMALIZE, (None, None)),  # no Pooling module
        (LAST, None, {"a": 1}, (None, "the model's modules.json is not a list of modules")),
    ],
)  # fmt: skip
def test_the_trained_pooling_is_read_from_sentence_transformers_files(
    tmp_path, modes, path, modules, want
):
    from mlxkv.models.pooling import trained_pooling

    model = tmp_path / "model"
    model.mkdir()
    assert trained_pooling(model) == (None, None)  # a chat model: no such files
    sentence_files(model, modes, path or "1_Pooling", modules)
    assert trained_pooling(model) == want
    (model / "modules.json").write_text("[")
    assert trained_pooling(model)[1].startswith(
        "the model's sentence-transformers files cannot be read (Expecting value"
    )


def test_an_embedding_models_files_set_its_pooling(tmp_path, short_model):
    """A model with sentence-transformers files pools as they say, the server saying so
    at its start, and Ollama's /api/show lists it as an embedding model; the flag wins."""
    import shutil

    model = shutil.copytree(short_model, tmp_path / "embedder")
    sentence_files(model, {"pooling_mode_mean_tokens": True})
    for s in serving(tmp_path / "a", str(model), "--force"):
        assert "mlxkv: embeddings are the mean of the states, as the model's sentence" in s.log()
        shown = s.http("POST", "/api/show", json={"model": s.model}).json()
        assert "embedding" in shown["capabilities"]
        r = s.http("POST", "/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 200
        assert "tokens, pooling mean\n" in s.log()
    for s in serving(tmp_path / "b", str(model), "--force", "--embedding-pooling", "last"):
        s.http("POST", "/v1/embeddings", json={"input": "hello"})
        assert "tokens, pooling last\n" in s.log() and "embeddings are the" not in s.log()
    plain = [
        s.http("POST", "/api/show", json={"model": s.model}).json()
        for s in serving(tmp_path / "c", str(short_model), "--force")
    ]
    assert "embedding" not in plain[0]["capabilities"]
