"""AMD's GPU tools: ``amd-smi list --json``, ``amd-smi static --asic --json`` and, where
amd-smi is missing or lists nothing, ``rocm-smi --showproductname --json``.
"""

from __future__ import annotations

from typing import Any

from pdctl.onhost.hardware.parsing import ParseError, load_json


def _gpu_records(data: object, what: str) -> list[dict[str, Any]]:
    if isinstance(data, dict) and "gpu_data" in data:
        data = data["gpu_data"]  # amd-smi >= 26 wraps its list
    if not isinstance(data, list):
        kind = f"an object with keys {sorted(data)[:5]}" if isinstance(data, dict) else type(data)
        raise ParseError(
            f'expected a JSON list of GPU records or {{"gpu_data": [...]}} from {what}, got {kind}'
        )
    for index, record in enumerate(data):
        if not isinstance(record, dict):
            raise ParseError(f"expected GPU record {index} from {what} to be an object")
    return data


def parse_amd_smi_list(text: str) -> list[dict[str, Any]]:
    """GPU records ({"gpu", "bdf", "uuid", ...}) from ``amd-smi list --json``."""
    return _gpu_records(load_json(text, "amd-smi list --json"), "amd-smi list --json")


def _market_name(record: dict[str, Any], index: int) -> str:
    asic = record.get("asic")
    if not isinstance(asic, dict):
        raise ParseError(
            f"expected an 'asic' object in GPU record {index} of amd-smi static --asic --json"
        )
    name = asic.get("market_name")
    if isinstance(name, str) and name.strip() and name.strip() != "N/A":
        return name.strip()
    board = record.get("board")
    product = board.get("product_name") if isinstance(board, dict) else None
    if isinstance(product, str) and product.strip() and product.strip() != "N/A":
        return product.strip()
    raise ParseError(f"expected asic.market_name in GPU record {index}, got {name!r}")


def parse_amd_smi_static(text: str) -> list[str]:
    """Market names, one per GPU, from ``amd-smi static --asic --json``."""
    what = "amd-smi static --asic --json"
    records = _gpu_records(load_json(text, what), what)
    return [_market_name(record, index) for index, record in enumerate(records)]


def parse_rocm_smi_products(text: str) -> list[str]:
    """Card series, one per card, from ``rocm-smi --showproductname --json``.

    Empty output is [] (rocm-smi prints nothing but a warning when it sees no
    GPU, and exits 0). The key is "Card Series" or "Card series" by version.
    """
    if not text.strip():
        return []
    data = load_json(text, "rocm-smi --showproductname --json")
    if not isinstance(data, dict):
        raise ParseError('expected a JSON object {"card0": {...}} from rocm-smi --showproductname')
    names: list[str] = []
    for card, fields in data.items():
        if not str(card).lower().startswith("card"):
            continue  # "system" and similar
        if not isinstance(fields, dict):
            raise ParseError(f"expected {card} to be an object in rocm-smi's JSON")
        series = next((v for k, v in fields.items() if str(k).lower() == "card series"), None)
        if not isinstance(series, str):
            raise ParseError(f"expected a 'Card Series' key for {card} in rocm-smi's JSON")
        names.append(series.strip())
    return names
