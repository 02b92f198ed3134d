"""ServiceSettings: the FLOWLOCK_* variables round trip, and a bad value is refused with an
InvalidInput naming its variable, before anything is opened."""

from __future__ import annotations

import hashlib

import pytest

from flowlock.core.errors import InvalidInput
from flowlock.service import ServiceSettings, create_app
from flowlock.service.settings import ENV, ApiToken, parse_tokens

SECRET = "s3cret-s3cret-s3cret"


def test_every_setting_round_trips_through_the_environment() -> None:
    """to_env then from_env gives the same settings, every field set (both token forms)."""
    settings = ServiceSettings(
        database_url="postgresql://u@db:5432/flowlock",
        redis_url="redis://cache:6379/1",
        app="myapp.workflows:all",
        api_tokens=parse_tokens(
            f"ops:{SECRET},{SECRET}-bare,root:{SECRET}-a:admin,eye:{SECRET}:r:read,odd:{SECRET}:x"
        ),
        open_metrics=True,
        require_if_match=True,
        max_body_bytes=4096,
        max_json_depth=8,
        pool_size=5,
        strategy="pessimistic",
        schema="tenant_a",
        drain_timeout=2.5,
        timers=False,
        outbox=False,
        metrics_dir="/tmp/metrics",
    )
    env = settings.to_env()
    assert set(env) == set(ENV.values())
    assert ServiceSettings.from_env(env) == settings
    assert ServiceSettings.from_env(ServiceSettings().to_env()) == ServiceSettings()
    assert ServiceSettings.from_env({}) == ServiceSettings()


def test_tokens_name_their_principal() -> None:
    """'name:secret' is principal name; a bare secret is 'token-' and 8 hex digits of its
    SHA-256; blanks between commas are skipped; the secret is not in the repr."""
    bare = f"{SECRET}-bare"
    tokens = parse_tokens(f" ops:{SECRET} ,, {bare} ")
    assert tokens == (
        ApiToken("ops", SECRET.encode()),
        ApiToken("token-" + hashlib.sha256(bare.encode()).hexdigest()[:8], bare.encode()),
    )
    assert SECRET not in repr(tokens)
    assert parse_tokens("") == ()


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("FLOWLOCK_MAX_BODY_BYTES", "lots"),
        ("FLOWLOCK_MAX_BODY_BYTES", "1"),
        ("FLOWLOCK_MAX_BODY_BYTES", "1.5"),
        ("FLOWLOCK_MAX_JSON_DEPTH", "1000"),
        ("FLOWLOCK_POOL_SIZE", "0"),
        ("FLOWLOCK_POOL_SIZE", "twenty"),
        ("FLOWLOCK_DRAIN_TIMEOUT", "soon"),
        ("FLOWLOCK_DRAIN_TIMEOUT", "-1"),
        ("FLOWLOCK_DRAIN_TIMEOUT", "nan"),
        ("FLOWLOCK_REQUIRE_IF_MATCH", "maybe"),
        ("FLOWLOCK_TIMERS", "sometimes"),
        ("FLOWLOCK_OUTBOX", "sometimes"),
        ("FLOWLOCK_OPEN_METRICS", "sometimes"),
        ("FLOWLOCK_API_TOKEN", "short"),
        ("FLOWLOCK_API_TOKEN", f"ops:{SECRET}, :{SECRET}"),
        ("FLOWLOCK_API_TOKEN", "ops:"),
        ("FLOWLOCK_API_TOKEN", "ops:tooshort"),
        ("FLOWLOCK_API_TOKEN", f"o\tps:{SECRET}"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(var: str, raw: str) -> None:
    """Each bad value: InvalidInput whose message starts with the variable's name."""
    with pytest.raises(InvalidInput) as caught:
        ServiceSettings.from_env({var: raw})
    assert str(caught.value).startswith(var), str(caught.value)


def test_a_short_token_says_how_to_make_a_good_one() -> None:
    """A token under 16 characters is refused, saying its length and how to make one."""
    with pytest.raises(InvalidInput, match="15 characters long; use at least 16") as caught:
        parse_tokens("ops:" + "x" * 15)
    assert "secrets.token_urlsafe" in str(caught.value)
    assert parse_tokens("ops:" + "x" * 16)[0].principal == "ops"


@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "bogus"},
        {"database_url": "mysql://db/x"},
        {"redis_url": "http://cache"},
    ],
)
def test_a_setting_the_engine_refuses_fails_create_app(settings: dict[str, str]) -> None:
    """What only the engine can check is refused by create_app, before anything is opened."""
    with pytest.raises(InvalidInput):
        create_app(ServiceSettings(**settings))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bounds",
    [{"max_body_bytes": 1}, {"max_json_depth": 501}, {"pool_size": 0}, {"drain_timeout": 0.0}],
)
def test_out_of_range_bounds_are_refused_when_built(bounds: dict[str, float]) -> None:
    """ServiceSettings built in code checks its bounds too."""
    with pytest.raises(InvalidInput):
        ServiceSettings(**bounds)  # type: ignore[arg-type]


def test_tokens_reach_the_workers_with_their_scope() -> None:
    """to_env writes each token's scope out, so a worker reads an admin token as admin and a
    read one as read (a secret that itself ends in ':read' stays that secret)."""
    tokens = parse_tokens(f"root:{SECRET}:admin,eye:{SECRET}-r:read,app:{SECRET}:read:write")
    assert [(t.principal, t.scope) for t in tokens] == [
        ("root", "admin"),
        ("eye", "read"),
        ("app", "write"),
    ]
    assert tokens[2].secret == f"{SECRET}:read".encode()
    again = ServiceSettings.from_env(ServiceSettings(api_tokens=tokens).to_env()).api_tokens
    assert again == tokens


def test_a_token_of_no_known_scope_is_refused() -> None:
    """ApiToken built in code with a scope that is not read, write or admin: InvalidInput."""
    with pytest.raises(InvalidInput, match="read, write, admin"):
        ApiToken("ops", SECRET.encode(), "root")


def test_one_scope_order_for_tokens_and_console_sessions() -> None:
    """`scope_allows` is the order every check uses (a token's `allows`, a console
    session's scope): read < write < admin; an unknown scope allows nothing."""
    from flowlock.service.settings import SCOPES, ApiToken, scope_allows

    for have in SCOPES:
        token = ApiToken("t", b"s" * 24, have)
        for needed in SCOPES:
            expected = SCOPES.index(have) >= SCOPES.index(needed)
            assert scope_allows(have, needed) is expected
            assert token.allows(needed) is expected
    assert not scope_allows("root", "read")
