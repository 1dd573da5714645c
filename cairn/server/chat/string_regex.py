"""A JSON-schema string as regexes over its raw text: what an XML-style tool-call parameter may hold.

Qwen3.5's calls write a string parameter's value as raw text (`<parameter=P>\\nVALUE\\n</parameter>`),
not as a JSON string, so llguidance's `%json` cannot hold it to its schema. `string_regexes(schema)`
gives the regexes (Rust `regex` syntax, as llguidance's Lark terminals read them, each matching the
whole text) that the value must match besides its length bounds:

    pattern   the ECMA-262 pattern, searched anywhere in the text as JSON Schema says: each top-level
              alternative gets `.*` on a side it does not anchor with `^` / `$`; ECMA meanings are
              kept where Rust's differ (`\\d`, `\\w` ASCII, `.` stops at any line terminator, `[[]`)
    format    date, time, date-time, duration (RFC 3339), email (RFC 5322's dot-atom form), hostname
              (RFC 1123, 253 characters at most), ipv4, ipv6 (RFC 4291), uuid, uri (RFC 3986): a regex
              per format; a value it allows follows the format's grammar (not every valid value is
              allowed: no IPv4-suffixed IPv6, no IPv6 host in a URI, no leap second, no quoted local part)

A keyword it cannot enforce is refused (SamplingError, a 400 naming the keyword), never ignored:
an unknown format, a pattern llguidance cannot compile (a back-reference, a look-around, an anchor
inside a group: found when the grammar is compiled) and any keyword that is neither one of the
above, a length bound, enum / const (handled by the caller) nor an annotation.

What this is not: the grammar of a whole call (`call_grammar`).
"""

from __future__ import annotations

from cairn.errors import SamplingError

HANDLED = {"type", "pattern", "format", "minLength", "maxLength", "enum", "const"}
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
               "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "nullable"}
ANY = "(?s:.*)"
_META = set("\\.+*?()|[]{}^$#&-~/")  # what Rust's regex reads as syntax (and `/`, which ends a Lark regex)

_DIGITS = "[0-9]"
_DEC_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = rf"{_DEC_OCTET}(?:\.{_DEC_OCTET}){{3}}"
_H16 = "[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join([rf"(?:{_H16}:){{7}}{_H16}", rf"(?:{_H16}:){{1,7}}:", f"::(?:{_H16}(?::{_H16}){{0,6}})?"]
                 + [rf"(?:{_H16}:){{1,{n}}}(?::{_H16}){{1,{7 - n}}}" for n in range(1, 7)])
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = rf"{_LABEL}(?:\.{_LABEL})*"
_LEAP_YEAR = "[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00"
_MONTH_DAY = "(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31"
_DATE = f"(?:[0-9]{{4}}-(?:{_MONTH_DAY})|(?:{_LEAP_YEAR})-02-29)"
_TIME = ("(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?"
         "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_N = "[0-9]+"
_DUR_TIME = f"T(?:{_N}H(?:{_N}M(?:{_N}S)?)?|{_N}M(?:{_N}S)?|{_N}S)"
_DUR_DATE = f"(?:{_N}D|{_N}M(?:{_N}D)?|{_N}Y(?:{_N}M(?:{_N}D)?)?)(?:{_DUR_TIME})?"
_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"  # RFC 3986
_AUTHORITY = (r"(?:(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|%[0-9A-Fa-f]{2})*@)?"  # userinfo
              r"(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})*(?::[0-9]*)?")  # reg-name (or IPv4), port
_HIER_PART = f"//{_AUTHORITY}(?:/{_PCHAR}*)*|/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?|{_PCHAR}+(?:/{_PCHAR}*)*|"
_QUERY = f"(?:{_PCHAR}|[/?])*"
_LOCAL_CHAR = r"[A-Za-z0-9!#$%&'*+\/=?^_`{|}~\-]"

FORMATS: dict[str, str | tuple[str, ...]] = {  # name -> the regex (or regexes) a value must match
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt]{_TIME}",
    "duration": f"P(?:{_DUR_DATE}|{_DUR_TIME}|{_N}W)",
    "email": rf"{_LOCAL_CHAR}+(?:\.{_LOCAL_CHAR}+)*@{_HOSTNAME}",
    "hostname": (_HOSTNAME, "(?s:.{1,253})"),
    "ipv4": _IPV4,
    "ipv6": f"(?:{_IPV6})",
    "uuid": "[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}",
    "uri": rf"[A-Za-z][A-Za-z0-9+.\-]*:(?:{_HIER_PART})(?:\?{_QUERY})?(?:#{_QUERY})?",
}
_DOT = "[^\\n\\r\\u2028\\u2029]"  # ECMA-262's `.`: anything but a line terminator
# \d \w and their negations: ASCII in ECMA-262 (Unicode in Rust's regex); a nested class works in a class too
_CLASS_ESCAPES = {"d": _DIGITS, "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}


def string_regexes(schema: dict, where: str) -> list[str]:
    """The regexes a raw string value must match for `schema` (beyond minLength / maxLength).
    `where` names the value in a refusal (`parameter city of get_weather`)."""
    unknown = sorted(k for k in schema if k not in HANDLED | ANNOTATIONS and not k.startswith("x-"))
    if unknown:
        raise SamplingError(f"tools is not usable: {where}: the keyword {unknown[0]!r} cannot be enforced on a "
                            "raw text value (XML-style calls); supported: " + ", ".join(sorted(HANDLED)))
    regexes = []
    if "pattern" in schema:
        if not isinstance(schema["pattern"], str):
            raise SamplingError(f"tools is not usable: {where}: 'pattern' must be a string")
        regexes.append(pattern_regex(schema["pattern"]))
    if "format" in schema:
        name = schema["format"]
        if not isinstance(name, str) or name not in FORMATS:
            raise SamplingError(f"tools is not usable: {where}: the 'format' {name!r} cannot be enforced; "
                                "supported: " + ", ".join(FORMATS))
        regex = FORMATS[name]
        regexes += [regex] if isinstance(regex, str) else list(regex)
    return regexes


def pattern_regex(pattern: str) -> str:
    """An ECMA-262 `pattern`, which JSON Schema searches for anywhere in the value, as a regex matching
    the whole value: `a|^b` -> `(?:.*(?:a).*|(?:b).*)` (with `.*` matching newlines too)."""
    alternatives = []
    for alt in _top_level_alternatives(_translate(pattern)):
        left = alt.startswith("^")
        right = alt.endswith("$") and _backslashes_before(alt, len(alt) - 1) % 2 == 0 and len(alt) > left
        body = alt[int(left): len(alt) - int(right)]
        alternatives.append(("" if left else ANY) + f"(?:{body})" + ("" if right else ANY))
    return "(?:" + "|".join(alternatives) + ")"


def one_of(texts: list[str]) -> str:
    """A regex matching exactly one of `texts`."""
    return "(?:" + "|".join("".join(_literal(ch) for ch in text) for text in texts) + ")"


def _literal(ch: str) -> str:
    if ch in _META:
        return "\\" + ch
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch, ch)


def lark_regex(regex: str) -> str:
    """`regex` as a Lark regex literal `/.../` (every unescaped `/` escaped)."""
    out, escaped = [], False
    for ch in regex:
        if ch == "/" and not escaped:
            out.append("\\")
        out.append(ch)
        escaped = ch == "\\" and not escaped
    return "/" + "".join(out) + "/"


def _translate(pattern: str) -> str:
    """ECMA-262 meanings in Rust regex terms: `\\d`, `\\w` and their negations as ASCII classes; `.` not
    matching a line terminator; `[`, `&`, `~` literal inside a class (Rust reads nested classes and set
    operations there)."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            out.append(_CLASS_ESCAPES.get(pattern[i + 1], pattern[i:i + 2]))
            i += 2
            continue
        if in_class:
            in_class = ch != "]" or out[-1] in ("[", "[^")
            out.append("\\" + ch if ch in "[&~" else ch)
        else:
            in_class = ch == "["
            out.append(_DOT if ch == "." else "[^" if pattern[i:i + 2] == "[^" else ch)
            i += 1 if pattern[i:i + 2] == "[^" else 0
        i += 1
    return "".join(out)


def _top_level_alternatives(regex: str) -> list[str]:
    """`regex` split at the `|` outside any group or character class."""
    parts, start, depth, in_class, i = [], 0, 0, 0, 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            in_class += 1
        elif ch == "]" and in_class:
            in_class -= 1
        elif not in_class and ch in "()":
            depth += 1 if ch == "(" else -1
        elif ch == "|" and not in_class and depth == 0:
            parts.append(regex[start:i])
            start = i + 1
        i += 1
    return parts + [regex[start:]]


def _backslashes_before(text: str, index: int) -> int:
    count = 0
    while index - count - 1 >= 0 and text[index - count - 1] == "\\":
        count += 1
    return count
