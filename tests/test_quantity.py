import pytest

from shim.decision.quantity import QuantityError, parse_bytes


@pytest.mark.parametrize(
    "text,value",
    [("128Mi", 128 * 2**20), ("1Gi", 2**30), ("100M", 10**8), ("1.5Gi", 3 * 2**29), ("2e3", 2000),
     ("0", 0), ("1k", 1000), ("0.5", 1), ("100m", 1), (" 64Mi ", 64 * 2**20), (5, 5), ("1E", 10**18)],
)
def test_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "Mi", "12Qi", "-1Mi", "1e999", "9" * 80, "1.2.3", None, True, 1.5, "16Ei"])
def test_reject(text):
    with pytest.raises(QuantityError):
        parse_bytes(text)
