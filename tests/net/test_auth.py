import pytest

from kvctl.errors import UsageError
from kvctl.net.auth import RequestVerifier, check_response, new_nonce, respond, sign_request
from kvctl.net.bind import parse_listen


def test_challenge_response_accepts_only_the_right_token() -> None:
    nonce = new_nonce()
    answer = respond("tok", nonce, b"kvctl-tcp/1")
    assert check_response("tok", nonce, b"kvctl-tcp/1", answer)
    assert not check_response("other", nonce, b"kvctl-tcp/1", answer)
    assert not check_response("tok", new_nonce(), b"kvctl-tcp/1", answer)
    assert not check_response("tok", nonce, b"kvctl-store/1", answer)  # context bound
    assert b"tok" not in answer


def test_signed_request_verifies_once() -> None:
    verifier = RequestVerifier("tok")
    headers = sign_request("tok", "PUT", "/v1/kv/a", b"body")
    assert "tok" not in "".join(headers.values())
    assert verifier.verify("PUT", "/v1/kv/a", b"body", headers)
    assert not verifier.verify("PUT", "/v1/kv/a", b"body", headers)  # replayed nonce


@pytest.mark.parametrize(
    ("method", "path", "body", "token"),
    [("GET", "/v1/kv/a", b"body", "tok"), ("PUT", "/v1/kv/b", b"body", "tok"),
     ("PUT", "/v1/kv/a", b"other", "tok"), ("PUT", "/v1/kv/a", b"body", "bad")],
)
def test_signed_request_rejects_any_change(method: str, path: str, body: bytes, token: str
                                           ) -> None:
    headers = sign_request(token, "PUT", "/v1/kv/a", b"body")
    if token == "tok" and (method, path, body) == ("PUT", "/v1/kv/a", b"body"):
        pytest.fail("parametrization must change something")
    assert not RequestVerifier("tok").verify(method, path, body, headers)


def test_stale_or_malformed_timestamps_are_refused() -> None:
    verifier = RequestVerifier("tok", window_s=30)
    old = sign_request("tok", "GET", "/", b"", now=1000.0)
    assert not verifier.verify("GET", "/", b"", old, now=1100.0)
    assert not verifier.verify("GET", "/", b"", {"X-Kvctl-Time": "x"})
    assert "tok" not in repr(verifier)


def test_parse_listen_defaults_to_loopback() -> None:
    assert parse_listen("") == ("127.0.0.1", 0)
    assert parse_listen(":8080") == ("127.0.0.1", 8080)
    assert parse_listen("0.0.0.0:9") == ("0.0.0.0", 9)
    assert parse_listen("[::1]:9") == ("::1", 9)
    with pytest.raises(UsageError):
        parse_listen("host:notaport")
    with pytest.raises(UsageError):
        parse_listen("host:70000")
