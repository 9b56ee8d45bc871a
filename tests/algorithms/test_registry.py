import pytest
import torch

from hybrid_rl.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    aggregate_loss,
    get_advantage_estimator,
    get_policy_loss,
    kl_penalty,
)


def test_register_get_aliases_and_names():
    reg = Registry("widget")

    @reg.register("b", "a")
    def fn():
        return 1

    assert fn() == 1  # decorator returns the function unchanged
    assert reg.get("a") is reg.get("b") is fn
    assert reg.names() == ["a", "b"]
    assert "a" in reg and "c" not in reg
    assert reg.register("b")(fn) is fn  # re-registering the same function is allowed


def test_register_clash_raises_and_leaves_registry_unchanged():
    reg = Registry("widget")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="'a' is already registered"):
        reg.register("new", "a")(lambda: 2)
    assert "new" not in reg


def test_unknown_name_lists_sorted_valid_names():
    reg = Registry("widget")
    for name in ("zeta", "alpha", "mid"):
        reg.register(name)(lambda: None)
    with pytest.raises(ValueError) as err:
        reg.get("alpah")
    assert str(err.value) == "Unknown widget 'alpah'. Valid: alpha, mid, zeta"


@pytest.mark.parametrize(
    "call, kind, valid",
    [
        (lambda: get_advantage_estimator("grpoo"), "advantage estimator", ADV_ESTIMATORS),
        (lambda: get_policy_loss("ppo"), "policy loss", POLICY_LOSSES),
        (lambda: kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4"), "KL estimator", KL_ESTIMATORS),
        (lambda: aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "seq-sum"), "loss aggregation mode", LOSS_AGG_MODES),
    ],
)
def test_public_lookups_name_kind_and_valid_names(call, kind, valid):
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(f"Unknown {kind} ")
    assert msg.endswith("Valid: " + ", ".join(sorted(valid.names())))


def test_expected_names_and_aliases():
    assert {"grpo", "rloo"} <= set(ADV_ESTIMATORS.names())
    assert {"vanilla", "reinforce"} <= set(POLICY_LOSSES.names())
    assert set(LOSS_AGG_MODES.names()) == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }
    for group in (["k1", "kl"], ["k2", "mse", "k2+", "mse+"], ["k3", "low_var_kl"], ["k1+", "kl+"], ["k3+", "low_var_kl+"]):
        fns = {KL_ESTIMATORS.get(name) for name in group}
        assert len(fns) == 1, group
    assert KL_ESTIMATORS.get("k3+") is not KL_ESTIMATORS.get("k3")
