"""What the client says to a newcomer's mistakes: each message names the argument, the shape or
keyword meant, or the server dialled, never numpy's or an internal function's words."""

from __future__ import annotations

import pytest
from logprob_client import LogprobClient, Unavailable

from tests.helpers.processes import free_port


@pytest.fixture(scope="module")
def client():
    # Nothing listens there: every check below is made before a call, but list_models'.
    with LogprobClient(f"127.0.0.1:{free_port()}", connect_timeout_s=2, timeout=2) as opened:
        yield opened


def test_one_dimensional_inputs_are_refused_as_such(client):
    with pytest.raises(ValueError, match=r"prompt_ids must be 2-D, a list of token-id sequences") as err:
        client.score([1, 2, 3], [4, 5])
    assert "3 prompts but 2 completions" not in str(err.value)
    with pytest.raises(ValueError, match=r"2 prompts but 1 completions: one completion per prompt"):
        client.score([[1, 2], [3]], [[4, 5]])


def test_ragged_candidate_ids_name_the_argument_and_the_shape(client):
    with pytest.raises(ValueError, match=r"candidate_ids\[0\] is ragged .*\(C, Kc\)") as err:
        client.score([[1, 2]], [[3, 4]], candidate_ids=[[[1, 2], [3]]])
    assert "inhomogeneous" not in str(err.value)


def test_a_misspelt_keyword_names_the_method_called_and_the_keyword_meant(client):
    with pytest.raises(
        TypeError, match=r"^score\(\) got an unexpected keyword argument 'tempreature'; did you mean 'temperature'\?$"
    ):
        client.score([[1, 2]], [[3, 4]], tempreature=1.0)
    with pytest.raises(TypeError, match=r"^score_many\(\) got an unexpected keyword argument 'retrun_entropy'"):
        client.score_many([], retrun_entropy=True)


def test_temperature_zero_is_the_default_as_the_server_says(client):
    scoring = client.prepare_one([[1, 2]], [[3, 4]], {"temperature": 0})
    (_, (request,)) = scoring.calls[0]
    assert request.temperature == 0  # the wire's unset: the server scores at 1.0
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0 \(0: the default, 1.0\), got -1"):
        client.score([[1, 2]], [[3, 4]], temperature=-1)


def test_list_models_on_a_port_nobody_serves_names_the_target(client):
    with pytest.raises(Unavailable) as err:
        client.list_models()
    target = client._described  # the target as given, quoted: gRPC's own words name only an address
    assert target.startswith("'127.0.0.1:") and f"UNAVAILABLE: {target}: " in str(err.value)
