"""The expert-load figure for TensorBoard, drawn with numpy alone so every install gets a labelled picture.

A figure is an RGB uint8 array [H, W, 3]: a title with the step, one row of cells per MoE layer named
as the model names it, expert ids over the columns, each cell's load (expert's routed choices over
the layer's mean; 1.0 = balanced) written in it where it fits, and a colour bar of the scale.
Text uses a built-in 3x5 capital font, so no plotting library is needed (lower case is drawn in capitals).
Nothing here reads devices or tensors: the monitor passes Python numbers.
"""

import numpy as np

__all__ = ["expert_load_figure", "load_colours", "text_image"]

# Each glyph: five rows of three pixels, one octal digit per row (4 = left pixel, 2 = middle, 1 = right).
_GLYPHS = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717", "6": "74757",
    "7": "71122", "8": "75757", "9": "75717", "A": "25755", "B": "65656", "C": "34443", "D": "65556",
    "E": "74647", "F": "74644", "G": "34553", "H": "55755", "I": "72227", "J": "11152", "K": "55655",
    "L": "44447", "M": "57755", "N": "65555", "O": "25552", "P": "65644", "Q": "25563", "R": "65655",
    "S": "34216", "T": "72222", "U": "55557", "V": "55552", "W": "55775", "X": "55255", "Y": "55222",
    "Z": "71247", ".": "00002", ",": "00024", "-": "00700", "_": "00007", "/": "11244", ":": "02020",
    "=": "07070", "(": "12221", ")": "42224", "+": "02720", ">": "42124", "%": "51245", " ": "00000",
    "?": "71202",
}
SCALE = 2  # screen pixels per font pixel
ADVANCE = 4 * SCALE  # a glyph and its gap
TEXT_HEIGHT = 5 * SCALE
BACKGROUND, INK, LINE, PAD = 255, 0, 160, 128  # grey levels: page, text, cell borders, missing experts
MARGIN = 8
LOAD_MAX = 2.0  # the colour scale ends at twice the mean load


def text_image(text: str) -> np.ndarray:
    """A bool mask [TEXT_HEIGHT, len(text) * ADVANCE - SCALE] of `text` in the built-in font."""
    rows = np.zeros((5, max(4 * len(text) - 1, 0)), dtype=bool)
    for i, char in enumerate(text.upper()):
        for y, digit in enumerate(_GLYPHS.get(char, _GLYPHS["?"])):
            rows[y, 4 * i:4 * i + 3] = [(int(digit) >> shift) & 1 for shift in (2, 1, 0)]
    return rows.repeat(SCALE, axis=0).repeat(SCALE, axis=1)


def load_colours(load: np.ndarray) -> np.ndarray:
    """RGB uint8 [..., 3] of loads: white at 1.0 (balanced), red at LOAD_MAX or more, blue at 0."""
    x = (np.clip(np.asarray(load, dtype=np.float64), 0, LOAD_MAX) - 1)[..., None]  # in [-1, 1]
    over, under = np.clip(x, 0, None), np.clip(-x, 0, None)
    colour = 1.0 - over * np.array([0.0, 1.0, 1.0]) - under * np.array([1.0, 1.0, 0.0])
    return (colour * 255).round().astype(np.uint8)


def _put(image: np.ndarray, text: str, y: int, x: int, align: str = "left", ink=INK) -> None:
    """Write `text` with its top at row y; x is its left edge, right edge or centre by `align`."""
    mask = text_image(text)
    width = mask.shape[1]
    x = {"left": x, "right": x - width, "centre": x - width // 2}[align]
    image[y:y + mask.shape[0], x:x + width][mask] = ink


def _value(load: float) -> str:
    return f"{load:.1f}" if load < 9.95 else f"{load:.0f}"


def expert_load_figure(names: list[str], loads: list[list[float]], step: int) -> np.ndarray:
    """The labelled experts x layers picture of one step's loads.

    Args:
        names: each layer's module name (the root module, named "", is shown as "(model)").
        loads: per layer, each expert's routed choices over the layer's mean (1.0 = balanced).
        step: the optimizer step, shown in the title.

    Returns:
        an RGB uint8 array [H, W, 3]; it grows with the layers (rows) and the experts (columns).
    """
    experts = max(len(row) for row in loads)
    cell_w = max(4, min(32, 512 // experts))
    cell_h = max(TEXT_HEIGHT + 6, min(cell_w, 24))
    every = 1  # label every expert id that fits over its column
    while every * cell_w < len(str(experts - 1)) * ADVANCE + 2:
        every *= 2
    labels = [name or "(model)" for name in names] + ["expert", "load/mean"]
    label_w = max(len(label) for label in labels) * ADVANCE
    grid_x, grid_y = MARGIN + label_w + ADVANCE, MARGIN + 2 * TEXT_HEIGHT + 10
    grid_w, grid_h = experts * cell_w + 1, len(loads) * cell_h + 1
    bar_w, bar_y = max(128, min(grid_w, 256)), grid_y + grid_h + 12
    title = f"expert load / mean, step {step}"
    width = max(grid_x + max(grid_w, bar_w + 2 * ADVANCE), MARGIN + len(title) * ADVANCE) + MARGIN
    height = bar_y + 2 * TEXT_HEIGHT + 8 + MARGIN
    image = np.full((height, width, 3), BACKGROUND, dtype=np.uint8)

    _put(image, title, MARGIN, MARGIN)
    # 1. the cells: one row per layer, grey where a layer has fewer experts, borders between cells
    cells = np.full((len(loads), experts, 3), PAD, dtype=np.uint8)
    for row, load in enumerate(loads):
        cells[row, :len(load)] = load_colours(load)
    grid = image[grid_y:grid_y + grid_h, grid_x:grid_x + grid_w]
    grid[:-1, :-1] = cells.repeat(cell_h, axis=0).repeat(cell_w, axis=1)
    grid[::cell_h], grid[:, ::cell_w] = LINE, LINE
    # 2. the labels: layer names left of their rows, expert ids over their columns, values in the cells
    _put(image, "expert", grid_y - TEXT_HEIGHT - 4, grid_x - ADVANCE, "right")
    for e in range(0, experts, every):
        _put(image, str(e), grid_y - TEXT_HEIGHT - 4, grid_x + e * cell_w + cell_w // 2 + 1, "centre")
    for row, (label, load) in enumerate(zip(labels, loads)):
        top = grid_y + row * cell_h + (cell_h - TEXT_HEIGHT) // 2 + 1
        _put(image, label, top, grid_x - ADVANCE, "right")
        for e, value in enumerate(load):
            if len(_value(value)) * ADVANCE + 2 <= cell_w:  # a value on a dark colour is written in white
                dark = abs(min(value, LOAD_MAX) - 1) > 0.6
                _put(image, _value(value), top, grid_x + e * cell_w + cell_w // 2 + 1, "centre",
                     BACKGROUND if dark else INK)
    # 3. the colour bar: 0 to LOAD_MAX, ticks at every half
    _put(image, "load/mean", bar_y, grid_x - ADVANCE, "right")
    image[bar_y:bar_y + TEXT_HEIGHT, grid_x:grid_x + bar_w] = load_colours(np.linspace(0, LOAD_MAX, bar_w))
    for tick in np.arange(0, LOAD_MAX + 0.25, 0.5):
        x = grid_x + round(tick / LOAD_MAX * (bar_w - 1))
        image[bar_y + TEXT_HEIGHT:bar_y + TEXT_HEIGHT + 3, x] = INK
        _put(image, f"{tick:g}" + ("+" if tick == LOAD_MAX else ""), bar_y + TEXT_HEIGHT + 5, x, "centre")
    return image
