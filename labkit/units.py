"""The course's one byte formatter (binary units, as torch and nvidia-smi report memory)."""


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, 2 decimals); below 1 KiB whole bytes: '512 B'."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n < 1024:
        return f"{sign}{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.2f} {unit}"
