"""``retry_while_store_down`` and the API's ``store_unavailable`` rule against real connection failures
(a PostgreSQL URL on a port nothing listens on), not imitations of them."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError, OperationalError

from services.eval_api.errors import store_busy, store_unavailable
from services.supervisor import free_port
from services.workers.store_retry import is_store_outage, retry_while_store_down


def _refused() -> OperationalError:
    engine = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none",
                           connect_args={"connect_timeout": 2})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        return exc
    finally:
        engine.dispose()
    raise AssertionError("something answered on a free port")


def test_a_refused_connection_is_an_outage_and_a_503():
    exc = _refused()
    assert is_store_outage(exc) and store_unavailable(exc) and not store_busy(exc)
    assert not is_store_outage(IntegrityError("INSERT", {}, Exception("duplicate key")))


def test_retries_until_the_store_answers_then_returns():
    failures = [_refused(), _refused()]
    slept, between = [], []

    def write() -> str:
        if failures:
            raise failures.pop()
        return "written"

    assert retry_while_store_down(write, what="a result", budget_s=60, sleep=slept.append,
                                  between=lambda: between.append(1)) == "written"
    assert len(slept) == 2 and len(between) == 2 and all(0 < s <= 60 for s in slept)


def test_gives_up_after_the_budget_and_raises_other_errors_at_once():
    calls = []

    def down() -> None:
        calls.append(1)
        raise _refused()

    with pytest.raises(OperationalError):
        retry_while_store_down(down, what="a result", budget_s=0.0, sleep=lambda _s: None)
    assert len(calls) == 1

    def broken() -> None:
        calls.append(1)
        raise IntegrityError("INSERT", {}, Exception("duplicate key"))

    with pytest.raises(IntegrityError):
        retry_while_store_down(broken, what="a result", budget_s=60, sleep=lambda _s: None)
    assert len(calls) == 2
