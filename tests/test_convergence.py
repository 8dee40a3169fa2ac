"""Measured orders of convergence (float64, fitted log-log slopes) against order()."""

import json

import pytest

from ocformer.analysis import (
    convergence_study,
    fitted_slope,
    local_slopes,
    study_model,
    study_stepper,
)
from ocformer.analysis.__main__ import _names, main
from ocformer.splitting import Strang

STEPS = (4, 8, 16)


def test_fitted_slope_is_exact_on_power_laws():
    dts = [0.5, 0.25, 0.125]
    assert abs(fitted_slope(dts, [3 * h**2 for h in dts]) - 2.0) < 1e-12


@pytest.mark.parametrize("error", [0.0, float("nan"), -1e-3])
def test_a_slope_through_an_error_without_a_logarithm_is_refused(error):
    """An error of 0 (exact) or NaN has no logarithm: polyfit would answer NaN."""
    with pytest.raises(ValueError, match="needs positive, finite values; got errors"):
        fitted_slope([0.5, 0.25, 0.125], [1e-2, 2.5e-3, error])
    with pytest.raises(ValueError, match="needs positive, finite values"):
        local_slopes([0.5, 0.25, 0.125], [1e-2, 2.5e-3, error])
    with pytest.raises(ValueError, match="got 2 step sizes and 3 errors"):
        fitted_slope([0.5, 0.25], [1e-2, 2.5e-3, 1e-4])


def test_the_table_separates_long_scheme_names():
    """A name of 14 characters or more filled its column: "hybridimplicit_euler"."""
    from ocformer.analysis import format_table

    refused = dict(status="refused", reason="r")
    result = dict(
        formulation="pre", seed=0, reference=dict(solver="tsit5", steps_per_layer=8),
        error="max abs", steps_per_layer=[4],
        schemes={"hybrid": refused, "implicit_euler": refused},
    )  # fmt: skip
    header = format_table(result).splitlines()[1].split()
    assert header == ["steps/layer", "hybrid", "implicit_euler"], header


def test_a_step_count_with_zero_error_is_skipped_as_exact():
    """A step count that equals the reference has error 0: it is listed under skipped
    as exact and the slope is fitted through the others (not NaN)."""
    import jax.numpy as jnp
    import jax.random as jr

    from ocformer.analysis._convergence import _scheme_study
    from ocformer.integration import Discretisation
    from ocformer.models import reformulate
    from ocformer.splitting import Lie

    model = study_model("pre")
    u0 = jr.normal(jr.PRNGKey(0), (5, 8), jnp.float64)
    # The reference is Lie itself at 16 steps per layer: that count is exact.
    u_ref = reformulate(model, discretisation=Discretisation(Lie(), steps_per_layer=16))(u0)
    column = _scheme_study("lie", Lie(), model, u0, u_ref, (4, 8, 16), 1.0, None)
    assert column["steps_per_layer"] == [4, 8]
    assert column["skipped"] == [
        dict(steps_per_layer=16, status="exact", reason="the error is 0 (equal to the reference)")
    ]
    assert column["slope"] == pytest.approx(column["local_slopes"][0]) and column["slope"] > 0


@pytest.mark.parametrize("formulation", ["pre", pytest.param("projected", marks=pytest.mark.slow)])
def test_lie_and_strang_orders(formulation):
    result = convergence_study(
        ["lie", "strang"], STEPS, formulation=formulation, reference_factor=4
    )
    lie, strang = result["schemes"]["lie"], result["schemes"]["strang"]
    assert lie["expected_order"] == 1 and strang["expected_order"] == 2
    assert strang["sub_solver"] == "midpoint"
    assert "Euler sub-steps would make a second-order splitting first order" in strang["note"]
    assert 0.8 <= lie["slope"] <= 1.3, lie
    assert 1.8 <= strang["slope"] <= 2.3, strang
    for r in (lie, strang):
        assert all(a > b for a, b in zip(r["errors"], r["errors"][1:]))


@pytest.mark.slow
def test_every_claimed_order_is_measured():
    """Every (stepper, formulation) whose order() claims an order converges at that order
    under refinement: measured local slopes at the finest steps within 0.3 of it.

    On the projected formulation Strang is second order only with the projection (term
    0) first in its sequence; every other sequence is first order."""
    sequences = [
        "strang(0,2,1)",
        "strang(1,0,2)",
        "strang(2,0,1)",
        "strang(1,2,0)",
        "strang(2,1,0)",
    ]
    cells = {
        "pre": ["lie", "strang", "parallel", "heun", "strang(1,0)"],
        "projected": ["lie", "strang", "heun", *sequences],
    }
    orders = {}
    for formulation, names in cells.items():
        result = convergence_study(names, STEPS, formulation=formulation, reference_factor=4)
        for name, r in result["schemes"].items():
            assert r["status"] == "ok", (formulation, name, r)
            assert abs(r["local_slopes"][-1] - r["expected_order"]) <= 0.3, (formulation, name, r)
            orders[formulation, name] = r["expected_order"]
            if formulation == "projected" and r["expected_order"] == 1 and "note" in r:
                # Not a second-order splitting that Euler sub-steps would spoil.
                assert "first order with any sub-flows" in r["note"], (name, r["note"])
    assert orders["pre", "strang(1,0)"] == 2  # Macaron
    assert [orders["projected", s] for s in sequences] == [2, 1, 1, 1, 1]


def test_refused_cells_are_recorded_and_the_rest_computed(capsys):
    result = convergence_study(["lie", "parallel"], STEPS, formulation="projected")
    cells = result["schemes"]
    assert cells["lie"]["status"] == "ok" and len(cells["lie"]["errors"]) == len(STEPS)
    assert cells["parallel"]["status"] == "refused"
    assert "discretisation.stepper" in cells["parallel"]["reason"]
    from ocformer.analysis import format_table

    assert "refused" in format_table(result)


@pytest.mark.slow
def test_diffrax_solver_orders_match_order():
    # Heun (order 2) and Bosh3 (order 3) on the
    # smooth pre-LN ODE (GELU model: a ReLU kink would cap every method at about 2).
    result = convergence_study(["heun", "bosh3"], STEPS, reference_factor=4)
    for name, r in result["schemes"].items():
        assert abs(r["slope"] - r["expected_order"]) <= 0.3, (name, r)


def test_relaxed_formulation_at_a_fixed_eps_is_studied_over_the_steps():
    result = convergence_study(
        ["kencarp3"], (4, 8), formulation="relaxed", relaxation_eps=0.1, reference_factor=2
    )
    # The reference takes at least 1/eps steps per layer (here 10 > 2 * 8).
    assert result["reference"] == dict(solver="tsit5", steps_per_layer=16, formulation="relaxed")
    r = result["schemes"]["kencarp3"]
    assert r["status"] == "ok" and r["expected_order"] == 3, r
    assert r["dt_over_eps"] == pytest.approx([2.5, 1.25], rel=1e-12)
    assert r["errors"][0] > r["errors"][1] > 0
    with pytest.raises(ValueError, match="formulation='relaxed'"):
        convergence_study(["kencarp3"], formulation="pre", relaxation_eps=0.1)
    assert main(["convergence", "--formulation", "pre", "--relaxation-eps", "0.1"]) == 2


def test_a_given_model_is_studied_under_its_own_formulation_only():
    """A pre-LN model asked to be studied as "projected" is refused (the table would
    carry the wrong name); without ``formulation`` the model's own is used."""
    pre = study_model("pre")
    with pytest.raises(ValueError, match="does not describe the model given"):
        convergence_study(["lie"], (2, 4), formulation="projected", model=pre)
    with pytest.raises(ValueError, match="does not describe the model given"):
        convergence_study(["lie"], (2, 4), formulation="pre", model=study_model("projected"))
    assert convergence_study(["lie"], (2, 4), model=pre)["formulation"] == "pre"


def test_scheme_names_keep_strang_sequences_whole():
    assert _names("lie,strang(1,0,2), strang(2, 1, 0),heun") == [
        "lie",
        "strang(1,0,2)",
        "strang(2, 1, 0)",
        "heun",
    ]
    assert study_stepper("strang(2, 1, 0)") == Strang(sub_solver="midpoint", sequence=(2, 1, 0))
    with pytest.raises(ValueError, match=r"strang\(1,0,2\)"):
        study_stepper("lie(1,0)")


def test_command_writes_json(tmp_path, capsys):
    path = tmp_path / "orders.json"
    argv = ["convergence", "--schemes", "lie,strang", "--steps", "4,8,16", "--json", str(path)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "slope" in table and "midpoint" in table
    result = json.loads(path.read_text())
    assert set(result["schemes"]) == {"lie", "strang"}
    assert result["reference"]["solver"] == "tsit5"
    assert main(["convergence", "--schemes", "rk4"]) == 2


@pytest.mark.slow  # about 17 s on the 2-core machine
def test_a_refused_step_count_leaves_the_scheme_s_other_counts_computed():
    """The rules refuse an implicit solver below 4 steps per layer: that count is
    skipped (with the reason, in the JSON and the table), the scheme's other counts are
    measured and fitted, and the other schemes' columns are whole."""
    from ocformer.analysis import format_table

    result = convergence_study(["kvaerno3", "heun"], (2, 4, 8), reference_factor=2)
    assert result["steps_per_layer"] == [2, 4, 8]
    implicit, heun = result["schemes"]["kvaerno3"], result["schemes"]["heun"]
    assert implicit["status"] == "ok" and implicit["steps_per_layer"] == [4, 8]
    assert len(implicit["errors"]) == 2 and len(implicit["local_slopes"]) == 1
    assert implicit["slope"] == pytest.approx(implicit["local_slopes"][0])
    [skip] = implicit["skipped"]
    assert skip["steps_per_layer"] == 2 and skip["status"] == "refused"
    assert "steps_per_layer >= 4" in skip["reason"]
    assert heun["steps_per_layer"] == [2, 4, 8] and "skipped" not in heun
    table = [line.split() for line in format_table(result).splitlines()]
    assert ["2", "refused", f"{heun['errors'][0]:.3e}"] in table
    assert ["4", f"{implicit['errors'][0]:.3e}", f"{heun['errors'][1]:.3e}"] in table
    assert ["local", "2-4", "refused", f"{heun['local_slopes'][0]:.3f}"] in table
    assert [
        "local",
        "4-8",
        f"{implicit['local_slopes'][0]:.3f}",
        f"{heun['local_slopes'][1]:.3f}",
    ] in table
    assert any(
        line.startswith("kvaerno3 refused at 2 steps/layer:")
        for line in format_table(result).splitlines()
    )
    # A scheme refused at all but one count has no slope: its column is the refusal.
    single = convergence_study(["kvaerno3"], (2, 4), reference_factor=2)["schemes"]["kvaerno3"]
    assert single["status"] == "refused" and single["reason"].startswith(
        "at steps per layer [2] (computed only at [4]):"
    )
