# Re-hash every file named by every manifest under outputs/manifests/. The rule has no output,
# so it runs whenever it is asked for, and it asks for nothing upstream: an audit must look at
# what is there, not rebuild it first. It is the one rule without `benchmark:`: Snakemake counts
# a benchmark file as an output, and its presence would mark the audit done and skip it.
rule audit:
    log:
        "logs/audit.log",
    conda:
        "../workflow/envs/reprorl.yaml"
    shell:
        "python -m reprorl audit > {log} 2>&1"
