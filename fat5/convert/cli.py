"""The options both converters share (convert/flan_to_fat5.py, convert/fat5_to_t5.py). Their command-line
convention is every FAT5 command's: fat5/cli.py."""


def add_output_arguments(parser, verify_help):
    """The options both converters share: shard size, replacing OUT, verification, non-finite weights."""
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors shard, e.g. 5GB, 500MB (default: 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it exists and is not empty (atomically: OUT is always either the "
                             "old or the new folder)")
    parser.add_argument("--no-verify", action="store_true", help=verify_help)
    parser.add_argument("--allow-non-finite", action="store_true",
                        help="convert tensors holding NaN or infinite values instead of refusing them")
