"""pdctl/onhost/hardware/amd.py on real tool output: amd-smi's list and static forms, rocm-smi's
product names (samples in tests/data/hardware/, sources in its README)."""

from __future__ import annotations

import json

import pytest

from pdctl.onhost.hardware.amd import (
    parse_amd_smi_list,
    parse_amd_smi_static,
    parse_rocm_smi_products,
)
from pdctl.onhost.hardware.parsing import ParseError
from tests.unit.onhost.hardware.samples import (
    AJEAN_STATIC_GPU_DATA,
    AJEAN_WARNINGS,
    AMD_LIST_RECORD,
    AMD_LIST_TEXT,
    AMD_SMI_NO_DRIVER,
    ROCM_SMI_SERIES,
    ROCM_SMI_SERIES_LOWER,
    ROCM_SMI_TEXT,
)


def test_amd_smi_list_list_and_gpu_data_forms() -> None:
    assert parse_amd_smi_list(json.dumps([AMD_LIST_RECORD])) == [AMD_LIST_RECORD]
    assert parse_amd_smi_list(json.dumps({"gpu_data": [AMD_LIST_RECORD]})) == [AMD_LIST_RECORD]
    assert parse_amd_smi_list("[]\n") == []
    assert parse_amd_smi_list('{"gpu_data": []}') == []


def test_amd_smi_list_failures() -> None:
    with pytest.raises(ParseError, match="expected JSON from amd-smi list --json, got 'GPU: 0'"):
        parse_amd_smi_list(AMD_LIST_TEXT)
    with pytest.raises(ParseError, match="got empty output"):
        parse_amd_smi_list("")
    with pytest.raises(ParseError, match=r'\{"gpu_data": \[\.\.\.\]\}.*keys'):
        parse_amd_smi_list('{"nic_data": []}')
    with pytest.raises(ParseError, match=r"GPU record 1 .* to be an object"):
        parse_amd_smi_list("[{}, 3]")
    with pytest.raises(ParseError, match="expected JSON"):
        parse_amd_smi_list(AMD_SMI_NO_DRIVER)


def test_amd_smi_static_forms() -> None:
    listed = json.dumps([{"gpu": 0, "asic": {"market_name": "AMD Instinct MI300X"}}] * 2)
    assert parse_amd_smi_static(listed) == ["AMD Instinct MI300X"] * 2
    assert parse_amd_smi_static(AJEAN_STATIC_GPU_DATA) == ["AMD Radeon RX 7800 XT"]
    # warnings ahead of the document (as pasted from a terminal) are skipped
    assert parse_amd_smi_static(AJEAN_WARNINGS + AJEAN_STATIC_GPU_DATA) == ["AMD Radeon RX 7800 XT"]
    # a generic or missing market_name falls back to board.product_name
    generic = [{"gpu": 0, "asic": {"market_name": "N/A"}, "board": {"product_name": "MI308X OAM"}}]
    assert parse_amd_smi_static(json.dumps(generic)) == ["MI308X OAM"]


def test_amd_smi_static_failures() -> None:
    with pytest.raises(ParseError, match="expected an 'asic' object in GPU record 0"):
        parse_amd_smi_static(json.dumps([AMD_LIST_RECORD]))
    with pytest.raises(ParseError, match=r"expected asic\.market_name in GPU record 0"):
        parse_amd_smi_static('[{"gpu": 0, "asic": {"market_name": ""}}]')


def test_rocm_smi_products_key_case_and_empty_output() -> None:
    expected = ["AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2"]
    assert parse_rocm_smi_products(ROCM_SMI_SERIES) == expected
    assert parse_rocm_smi_products(ROCM_SMI_SERIES_LOWER) == expected
    with_system = json.loads(ROCM_SMI_SERIES)
    with_system["system"] = {"Driver version": "6.7.0"}
    with_system["card1"] = {"card SERIES": "AMD Instinct MI300X"}
    assert parse_rocm_smi_products(json.dumps(with_system)) == [*expected, "AMD Instinct MI300X"]
    assert parse_rocm_smi_products("") == []  # stdout when it prints ROCM_SMI_NO_JSON


def test_rocm_smi_products_failures() -> None:
    with pytest.raises(ParseError, match="expected JSON from rocm-smi"):
        parse_rocm_smi_products(ROCM_SMI_TEXT)
    with pytest.raises(ParseError, match="expected a 'Card Series' key for card0"):
        parse_rocm_smi_products('{"card0": {"Card Model": "0x74a1"}}')
    with pytest.raises(ParseError, match=r'expected a JSON object \{"card0"'):
        parse_rocm_smi_products("[]")
