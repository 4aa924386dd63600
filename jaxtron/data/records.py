"""A record's document text: a field, a dotted path into nested fields, or a template joining several.

Records come from JSON lines, Parquet and Arrow rows, and ``datasets``. ``--text-field meta.body`` reads
``record["meta"]["body"]``. ``--template '{{ title }}\\n\\n{{ body }}'`` renders jinja2 in a sandbox with the
record's fields as variables; a field the template names but a record lacks is an error, not an empty string.
A null text is an empty document, which the store skips, as it skips empty strings.
"""

from __future__ import annotations

from typing import Any

from jaxtron.data.errors import DataError


def field_names(record: Any) -> str:
    """The record's top-level field names, for a sentence that lists them."""
    return ", ".join(sorted(map(str, record))) if isinstance(record, dict) and record else "none"


class RecordText:
    """Reads one document's text from a record by ``field`` (dotted) or by ``template``. Pickles as its source."""

    def __init__(self, field: str = "text", template: str | None = None):
        if not field and not template:
            raise DataError("--text-field is empty; name the field that holds the text, or pass --template.")
        self.field, self.template = field, template
        self.path = tuple(field.split(".")) if field else ()
        self._compiled, self.columns = (None, (self.path[0],)) if not template else _compile(template)

    def __getstate__(self):
        return {"field": self.field, "template": self.template}

    def __setstate__(self, state):
        self.__init__(state["field"], state["template"])

    @property
    def flat(self) -> bool:
        """Whether the text is one top-level column, which columnar readers hand over without building records."""
        return self.template is None and len(self.path) == 1

    def text(self, record: Any, where: str) -> str | None:
        """The document text of ``record``; ``where`` names it in errors."""
        if self._compiled is not None:
            return self._render(record, where)
        value = record
        for depth, key in enumerate(self.path):
            if not isinstance(value, dict) or key not in value:
                inner = ".".join(self.path[:depth])
                names = field_names(value)
                at = f" (the fields of '{inner}' are: {names})" if depth else f" (its fields are: {names})"
                raise DataError(f"{where} has no text field '{self.field}'{at}; pass the right --text-field.")
            value = value[key]
        if value is None or isinstance(value, str):
            return value
        raise DataError(f"{where} holds a {type(value).__name__} in '{self.field}', not text; pass a --text-field "
                        "that holds strings, or a --template.")

    def _render(self, record: Any, where: str) -> str:
        import jinja2
        if not isinstance(record, dict):
            raise DataError(f"{where} is not an object with fields, so --template cannot read it.")
        try:
            return self._compiled.render(**record)
        except jinja2.UndefinedError as e:
            raise DataError(f"{where} lacks a field the --template uses ({e.message}); its fields are: "
                            f"{field_names(record)}.") from None
        except jinja2.TemplateError as e:
            raise DataError(f"the --template failed on {where} ({e}); fix the template.") from None


def _compile(source: str):
    """The template compiled in a sandbox with strict undefined variables, and the top-level fields it reads."""
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        parsed = env.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"--template is not valid jinja (line {e.lineno}: {e.message}); fix the template.") from None
    columns = tuple(sorted(meta.find_undeclared_variables(parsed)))
    if not columns:
        raise DataError("--template names no field, so every document would be the same text; use {{ field }}.")
    return env.from_string(source), columns
