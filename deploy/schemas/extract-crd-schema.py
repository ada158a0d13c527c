#!/usr/bin/python3
"""Writes the openAPIV3Schema of one version of a CustomResourceDefinition as
JSON, without the description texts (they make up ~90% of the file and play
no part in validation).

Usage: deploy/schemas/extract-crd-schema.py CRD.yaml VERSION > OUT.json
Needs PyYAML (Debian: python3-yaml, for /usr/bin/python3).
"""
import json
import sys

import yaml


def strip_descriptions(node):
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: extract-crd-schema.py CRD.yaml VERSION > OUT.json")
    crd_path, version = sys.argv[1], sys.argv[2]
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    if crd.get("kind") != "CustomResourceDefinition":
        sys.exit(f"{crd_path}: kind is {crd.get('kind')!r}, expected CustomResourceDefinition")
    versions = [v for v in crd["spec"]["versions"] if v["name"] == version]
    if not versions:
        names = [v["name"] for v in crd["spec"]["versions"]]
        sys.exit(f"{crd_path}: no version {version!r} (has {names})")
    schema = strip_descriptions(versions[0]["schema"]["openAPIV3Schema"])
    out = {
        "x-moe-ep-source": {
            "group": crd["spec"]["group"],
            "kind": crd["spec"]["names"]["kind"],
            "version": version,
        },
        "schema": schema,
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
