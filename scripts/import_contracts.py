"""pdctl's own import-linter contract type, named in .importlinter (`make lint`).

``standard_library_only``: the code that runs on hosts may import the standard library and its
own package, nothing else. import-linter's ``forbidden`` contract can only name what may not be
imported, and a third-party package nobody thought to name would slip through; this contract
names what may be, so every other import breaks it.
"""

from __future__ import annotations

import sys

import grimp
from importlinter import Contract, ContractCheck, fields, output
from importlinter.application import contract_utils
from importlinter.application.contract_utils import AlertLevel
from importlinter.domain.helpers import module_expressions_to_modules


class StandardLibraryOnlyContract(Contract):
    """Every module under ``source_modules`` imports only the standard library (this Python's
    ``sys.stdlib_module_names``) and ``allowed_modules`` (with their descendants), directly.

    Options: ``source_modules`` (packages, descendants included), ``allowed_modules``,
    ``ignore_imports`` (``importer -> imported``, each with its reason beside it).
    """

    type_name = "standard_library_only"

    source_modules = fields.SetField(subfield=fields.ModuleExpressionField())
    allowed_modules = fields.SetField(subfield=fields.ModuleExpressionField())
    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph,
            ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=AlertLevel.ERROR,
        )
        sources = [m.name for m in module_expressions_to_modules(graph, self.source_modules)]  # type: ignore[arg-type]
        allowed = [m.name for m in module_expressions_to_modules(graph, self.allowed_modules)]  # type: ignore[arg-type]
        importers = sorted(
            {
                module
                for source in sources
                for module in graph.modules
                if module == source or module.startswith(source + ".")
            }
        )
        broken: list[dict[str, object]] = []
        for importer in importers:
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if _within(imported, allowed) or imported.split(".")[0] in sys.stdlib_module_names:
                    continue
                lines = [
                    d["line_number"]
                    for d in graph.get_import_details(importer=importer, imported=imported)
                ]
                broken.append({"importer": importer, "imported": imported, "lines": lines})
        return ContractCheck(
            kept=not broken,
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
            metadata={"broken": broken},
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        for item in check.metadata["broken"]:
            lines = ", ".join(f"l.{n}" for n in item["lines"])
            output.print_error(f"{item['importer']} -> {item['imported']} ({lines})", bold=True)
            output.new_line()


def _within(module: str, packages: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)
