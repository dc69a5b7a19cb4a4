"""``python -m epl.profile DIR [--step N] [--png PATH]``: the breakdown of the traces
in DIR (profile.dir), and their picture (DIR/profile.png by default)."""
import argparse
import sys

from epl.profile import analysis, render


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m epl.profile", description=__doc__)
    ap.add_argument("folder", help="profile.dir of the traced job")
    ap.add_argument("--step", type=int, help="the traced run to draw (default: the last)")
    ap.add_argument("--graph", type=int, default=1,
                    help="with --step: the traced graph (files worker<k>_graph<g>_...)")
    ap.add_argument("--png", help="where to write the picture (default: FOLDER/profile.png)")
    a = ap.parse_args(argv)
    try:
        print(analysis.report(a.folder))
        print("picture: %s" % render.render_folder(a.folder, a.step, a.png, a.graph))
    except (ValueError, KeyError, OSError) as e:
        sys.exit("epl.profile: %s" % e)


if __name__ == "__main__":
    main()
