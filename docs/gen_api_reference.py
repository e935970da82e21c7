"""Generate docs/api.md from the comments in protos/tokenloop/v1/*.proto.

protoc (from grpcio-tools) writes a descriptor set with --include_source_info; the leading comment of
every service, RPC, message, field, oneof, enum and enum value comes from its SourceCodeInfo.
Anything without a comment is an error: the .proto is the documentation.

    python docs/gen_api_reference.py           # rewrite docs/api.md
    python docs/gen_api_reference.py --check   # exit 1 when docs/api.md is stale or a comment is missing
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2 as d

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTOS = ("tokenloop/v1/tokenloop.proto",)
OUT = ROOT / "docs" / "api.md"
# Field numbers of the repeated fields in descriptor.proto that SourceCodeInfo paths walk through.
MESSAGE, ENUM, SERVICE = 4, 5, 6
FIELD, NESTED, NESTED_ENUM, ONEOF = 2, 3, 4, 8
METHOD, VALUE = 2, 2
SCALARS = {v: k[len("TYPE_"):].lower() for k, v in d.FieldDescriptorProto.Type.items()}


def load_files() -> list[d.FileDescriptorProto]:
    """Run protoc with source info and return our files' descriptors."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.binpb"
        args = ["protoc", f"-I{PROTO_ROOT}", "--include_source_info", f"--descriptor_set_out={out}",
                *(str(PROTO_ROOT / p) for p in PROTOS)]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        fds = d.FileDescriptorSet.FromString(out.read_bytes())
    return [f for f in fds.file if f.name in PROTOS]


class Comments:
    """Leading comments by SourceCodeInfo path; records the paths asked for that have none."""

    def __init__(self, file: d.FileDescriptorProto) -> None:
        self.by_path = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
        self.missing: list[str] = []

    def get(self, path: tuple[int, ...], name: str) -> str:
        """The comment as one Markdown paragraph (newlines joined)."""
        lines = self.by_path.get(path, "").strip().splitlines()
        text = " ".join(line.strip() for line in lines).replace("|", "\\|")
        if not text:
            self.missing.append(name)
        return text


def type_name(field: d.FieldDescriptorProto, package: str) -> str:
    """A field's type as a Markdown link for messages / enums, else the scalar name."""
    if field.type_name:
        short = field.type_name.lstrip(".").removeprefix(package + ".")
        return f"[`{short}`](#{short.lower().replace('.', '')})"
    return f"`{SCALARS[field.type]}`"


def label(field: d.FieldDescriptorProto, msg: d.DescriptorProto) -> str:
    """repeated / optional / oneof NAME / blank."""
    if field.label == d.FieldDescriptorProto.LABEL_REPEATED:
        return "repeated"
    if field.proto3_optional:
        return "optional"
    if field.HasField("oneof_index"):
        return f"oneof `{msg.oneof_decl[field.oneof_index].name}`"
    return ""


def render_message(msg: d.DescriptorProto, path: tuple, c: Comments, package: str, prefix: str = "") -> list[str]:
    """A heading, the message's comment and a table of its fields (then nested types)."""
    full = prefix + msg.name
    out = [f"### {full}", "", c.get(path, full), ""]
    if msg.field:
        out += ["| field | JSON name | type | label | description |", "| --- | --- | --- | --- | --- |"]
        for i, f in enumerate(msg.field):
            text = c.get((*path, FIELD, i), f"{full}.{f.name}")
            out.append(f"| `{f.name}` = {f.number} | `{f.json_name}` | {type_name(f, package)} | "
                       f"{label(f, msg)} | {text} |")
        out.append("")
    real_oneofs = [(i, o) for i, o in enumerate(msg.oneof_decl) if not o.name.startswith("_")]
    for i, oneof in real_oneofs:
        members = ", ".join(f"`{f.name}`" for f in msg.field if f.HasField("oneof_index") and f.oneof_index == i)
        out += [f"oneof `{oneof.name}` ({members}): {c.get((*path, ONEOF, i), f'{full}.{oneof.name}')}", ""]
    for i, nested in enumerate(msg.nested_type):
        out += render_message(nested, (*path, NESTED, i), c, package, full + ".")
    for i, enum in enumerate(msg.enum_type):
        out += render_enum(enum, (*path, NESTED_ENUM, i), c, full + ".")
    return out


def render_enum(enum: d.EnumDescriptorProto, path: tuple, c: Comments, prefix: str = "") -> list[str]:
    """A heading, the enum's comment and a table of its values."""
    full = prefix + enum.name
    out = [f"### {full}", "", c.get(path, full), "", "| value | number | description |", "| --- | --- | --- |"]
    for i, v in enumerate(enum.value):
        out.append(f"| `{v.name}` | {v.number} | {c.get((*path, VALUE, i), f'{full}.{v.name}')} |")
    return [*out, ""]


def render_service(svc: d.ServiceDescriptorProto, path: tuple, c: Comments, package: str) -> list[str]:
    """A heading, the service's comment and a table of its RPCs."""
    out = [f"### {package}.{svc.name}", "", c.get(path, svc.name), "",
           "| RPC | request | response | description |", "| --- | --- | --- | --- |"]
    for i, m in enumerate(svc.method):
        req = m.input_type.lstrip(".").removeprefix(package + ".")
        res = m.output_type.lstrip(".").removeprefix(package + ".")
        stream = "stream " if m.server_streaming else ""
        out.append(f"| `{m.name}` | [`{req}`](#{req.lower()}) | {stream}[`{res}`](#{res.lower()}) | "
                   f"{c.get((*path, METHOD, i), f'{svc.name}.{m.name}')} |")
    return [*out, ""]


def render(files: list[d.FileDescriptorProto]) -> tuple[str, list[str]]:
    """The whole api.md text and the names that lack a comment."""
    out = ["# tokenloop API reference", "",
           "<!-- Generated by docs/gen_api_reference.py from the .proto comments; do not edit. -->", "",
           ("JSON names are what grpcurl and `buf curl` users type (lowerCamelCase). Unset `optional` "
            "fields take the server's default."), ""]
    missing: list[str] = []
    for file in files:
        c = Comments(file)
        out += [f"Source: `protos/{file.name}`, package `{file.package}`.", "", "## Services", ""]
        for i, svc in enumerate(file.service):
            out += render_service(svc, (SERVICE, i), c, file.package)
        out += ["## Messages", ""]
        for i, msg in enumerate(file.message_type):
            out += render_message(msg, (MESSAGE, i), c, file.package)
        out += ["## Enums", ""]
        for i, enum in enumerate(file.enum_type):
            out += render_enum(enum, (ENUM, i), c)
        missing += c.missing
    return "\n".join(out).rstrip() + "\n", missing


def main(argv: list[str] | None = None) -> int:
    """Write docs/api.md, or with --check report staleness and missing comments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    text, missing = render(load_files())
    for name in missing:
        print(f"undocumented in the .proto: {name}", file=sys.stderr)
    if args.check:
        stale = not OUT.exists() or OUT.read_text(encoding="utf-8") != text
        if stale:
            print(f"stale: {OUT.relative_to(ROOT)} (run: python docs/gen_api_reference.py)", file=sys.stderr)
        return 1 if stale or missing else 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
