"""GenerationClient and ServerPool against stand-ins for the generation server: python's http.server in a thread,
answering /generate with each prompt echoed and the port the request came from (no vLLM)."""
import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from apmpo.rollout import GenerationClient, Sampling
from apmpo.rollout.pool import ServerPool


class EchoServer(ThreadingHTTPServer):
    """POST /generate: sample j of prompt i is the prompt's ids, its text the client's port; every body is kept."""
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Echo)
        self.bodies: list[dict] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a session's requests reuse its connection

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        sample = lambda prompt: {"token_ids": prompt, "text": str(self.client_address[1]),  # noqa: E731
                                 "logprobs": [0.0] * len(prompt), "finish_reason": "stop"}
        answer = json.dumps({"outputs": [[sample(p)] * body["n"] for p in body["prompts"]],
                             "weight_version": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def echo_server():
    server = EchoServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_each_thread_has_a_session_of_its_own_and_gets_its_own_answers(monkeypatch):
    # In asynchronous training the rollout thread generates while the main thread pushes: requests does not
    # promise that one Session may be used by several threads at once.
    closed = []
    close = requests.Session.close
    monkeypatch.setattr(requests.Session, "close", lambda session: (closed.append(session), close(session))[1])
    threads, calls = 8, 20
    ports: dict[int, set[str]] = {t: set() for t in range(threads)}
    sessions: dict[int, requests.Session] = {}
    wrong: list[tuple] = []
    start = threading.Barrier(threads)
    with echo_server() as server, GenerationClient(server.url) as client:
        def hammer(t: int) -> None:
            start.wait()  # all at once
            for k in range(calls):
                [[sample]] = client.generate([[t, k]], Sampling(max_tokens=1))
                if sample.token_ids != [t, k]:
                    wrong.append((t, k, sample.token_ids))
                ports[t].add(sample.text)
            sessions[t] = client._session()

        workers = [threading.Thread(target=hammer, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert not wrong and len(server.bodies) == threads * calls
        # One session per thread, each on one connection (keep-alive) that no other thread used.
        assert len({id(session) for session in sessions.values()}) == threads
        assert all(len(seen) == 1 for seen in ports.values()), ports
        assert len(set.union(*ports.values())) == threads
        # The sessions of threads that have ended are closed once another thread makes its own.
        client.generate([[1]], Sampling(max_tokens=1))
        assert {id(s) for s in closed} == {id(s) for s in sessions.values()}
        assert list(client._sessions) == [threading.current_thread()]
    assert len(closed) == threads + 1 and not client._sessions  # close() closed the last one


def test_a_pool_deals_one_contiguous_chunk_per_server_each_with_the_seed_of_one_request():
    prompts = [[i, i + 1] for i in range(5)]
    sampling = Sampling(max_tokens=3, temperature=0.6, top_p=0.9, top_k=20, stop_token_ids=(2,))
    with echo_server() as first, echo_server() as second, \
            ServerPool([GenerationClient(first.url), GenerationClient(second.url)]) as pool:
        outs = pool.generate(prompts, sampling, n=2, seed=100)
    assert [[s.token_ids for s in row] for row in outs] == [[p, p] for p in prompts]  # in prompt order
    (a,), (b,) = first.bodies, second.bodies  # one request each, at once
    # Prompt i of one request draws with seed + i * n: the second chunk starts at prompt 2, so at 100 + 2 * 2.
    assert (a["prompts"], a["seed"], b["prompts"], b["seed"]) == (prompts[:2], 100, prompts[2:], 104)
    # The wire format: every sampling field explicit, under the server's names.
    assert a == {"prompts": prompts[:2], "n": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 3,
                 "stop_token_ids": [2], "seed": 100}
