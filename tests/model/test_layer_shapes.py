"""The layer shapes (fastbert/layers/): a family's named axes pick one, each forward reads as its math on a screen,
and no model code asks which family it runs."""
import ast
import dataclasses
import pathlib

import pytest

from fastbert import families, layers

PACKAGE = pathlib.Path(layers.__file__).resolve().parents[1]
FAMILY_NAMES = {f.name.replace("-", "_") for f, _ in families.MODEL_TYPES.values()}
FAMILY_NAMES |= {t.replace("-", "_") for t in families.MODEL_TYPES}
FIELDS = {f.name for f in dataclasses.fields(families.Family)}
PROPERTIES = {n for n, v in vars(families.Family).items() if isinstance(v, property) or callable(v)}


@pytest.mark.parametrize("family, shape", [
    (families.BERT, layers.PostNormLayer), (families.ROBERTA, layers.PostNormLayer),
    (families.ELECTRA, layers.PostNormLayer), (families.DISTILBERT, layers.PostNormLayer),
    (families.MPNET, layers.PostNormLayer), (families.MODERNBERT, layers.PreNormLayer),
    (families.DEBERTA_V2, layers.DisentangledLayer)])
def test_the_axes_pick_the_layer_shape(family, shape):
    assert layers.layer_class(family) is shape


@pytest.mark.parametrize("axes", [dict(norm="pre"), dict(mlp="gated"), dict(windows=True),
                                  dict(norm="pre", mlp="gated", attention_bias="buckets")])
def test_an_axis_combination_no_shape_has_is_refused(axes):
    with pytest.raises(NotImplementedError, match="no layer shape has"):
        layers.layer_class(dataclasses.replace(families.BERT, **axes))


def test_no_family_field_is_named_after_a_family():
    assert not (FIELDS | PROPERTIES) & FAMILY_NAMES, (FIELDS | PROPERTIES) & FAMILY_NAMES


def _sources():
    return [p for p in PACKAGE.rglob("*.py") if p.name != "families.py"]


def test_model_code_reads_axes_never_which_family():
    """Every `family.X` the package reads is a Family field or property, and none compares a family's name: an axis
    says what it does; a family stays a data row."""
    unknown, by_name = [], []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)) \
                    and (getattr(node.value, "id", None) == "family" or getattr(node.value, "attr", None) == "family"):
                if node.attr not in FIELDS | PROPERTIES:
                    unknown.append(f"{path.name}:{node.lineno} family.{node.attr}")
                if node.attr == "name":
                    by_name.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Compare):
                names = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                if any(isinstance(n, str) and n.replace("-", "_") in FAMILY_NAMES - {"bert"} for n in names) \
                        and "family" in ast.unparse(node):
                    by_name.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not unknown, unknown
    assert not by_name, by_name


@pytest.mark.parametrize("shape", ["post_norm", "pre_norm", "disentangled"])
def test_each_layer_shapes_forward_fits_on_a_screen(shape):
    tree = ast.parse((PACKAGE / "layers" / f"{shape}.py").read_text())
    functions = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "forward" in functions or shape == "disentangled"  # DeBERTa's layer is post-norm's forward
    assert all(n <= 60 for n in functions.values()), functions
