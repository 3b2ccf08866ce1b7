# services.agentsandbox.settings for both modules: the config file's known
# keys, typed and documented, in a freeform TOML submodule (RFC 42), plus the
# refusals of agentsandbox/config.py that can be decided at evaluation time.
#
# Every known key defaults to null, and null keys are left out of the file, so
# the loader's own defaults apply (a module that wrote them out would freeze
# today's defaults into every config).  What Nix cannot decide (host names
# through IDNA, CIDR blocks, symlinks on the target machine, regular
# expressions) is still refused at build time: the NixOS drop-in's derivation
# and home-manager's config file's run the package's own loader on the
# generated file, and fail with its message.
{ lib }:
let
  inherit (lib)
    mkOption
    types
    hasPrefix
    concatLists
    imap0
    optional
    optionals
    ;

  opt =
    type: description:
    mkOption {
      type = types.nullOr type;
      default = null;
      inherit description;
    };

  positive = types.addCheck types.number (x: x > 0) // {
    description = "positive number";
  };
  envPattern = types.strMatching "[][A-Za-z0-9_*?]+";
  envName = types.strMatching "[A-Za-z_][A-Za-z0-9_]*";
  pathStr = types.str;
  action = types.enum [ "allow" "refuse" ];

  # One `[[inject.requests]]` / `[[github.requests]]` entry (docs/config.md).
  requestRule =
    tomlType:
    table tomlType {
      action = mkOption {
        type = action;
        description = "`allow` lets a matching request through, `refuse` answers it 403.";
      };
      path = mkOption {
        type = types.strMatching "/.*";
        description = "A path pattern: `*` inside a segment, `**` for any number of segments.";
      };
      methods = opt (types.listOf (types.strMatching "[A-Z][A-Z0-9_-]*")) "Methods it matches. Unset: any.";
      host = opt types.str "One of the rule's hosts it is limited to. Unset: all of them.";
    };

  table =
    tomlType: options:
    types.submodule {
      freeformType = tomlType;
      inherit options;
    };

  # The option tree; `known` below is derived from it, so the list of keys the
  # module knows and the keys it declares cannot disagree.
  schema = tomlType: {
    sandbox = {
      read = opt (types.listOf pathStr) ''
        Extra paths sessions may read inside home or the runtime dir (`~/…` or absolute).
        Everything outside home is readable anyway.
      '';
      write = opt (types.listOf pathStr) ''
        Paths sessions may write (checkouts agents work in). A write path may not lie inside a
        read path: the sandbox would mount the read path read-only over it.
      '';
      deny = opt (types.listOf pathStr) "Paths closed for reading and writing, even inside a write path.";
      domains = opt (types.listOf types.str) ''
        The egress allow list: `host`, `*.domain` (strict subdomains), `host:port`, `IP:port`,
        `CIDR[:port]`. Unset: GitHub's hosts. `[ ]` allows nothing. `*` and loopback without an
        explicit port are refused.
      '';
      unset_env = opt (types.listOf envPattern) "Variables (or `*`/`?` patterns) the SessionStart hook unsets in sandboxed Bash. Unset: the built-in list.";
      keep_env = opt (types.listOf envPattern) "Variables kept although `unset_env` matches them.";
      allow_tools = opt (types.listOf (types.enum [ "DesignSync" "PowerShell" "Workflow" ])) ''
        Claude Code tools the drop-in removes by default (`permissions.deny`) that this machine
        re-opens. Workflow reads its `scriptPath` before any hook runs: see docs/hook.md.
      '';
    };
    proxy = {
      port = mkOption {
        type = types.ints.between 1 65535;
        default = 3190;
        description = ''
          The loopback port every sandbox dials (the drop-in's `httpProxyPort`). With the
          dispatcher, the dispatcher's socket unit listens on it for every user.
        '';
      };
      listen = opt types.str "A Twisted endpoint string to listen on instead of `tcp:PORT:interface=127.0.0.1`.";
      parent = opt (types.strMatching "http://[^/@[:space:]]+:[0-9]+/?") "An upstream HTTP CONNECT proxy, `http://HOST:PORT`.";
      max_tunnels = opt types.ints.positive "Concurrent tunnels; past it the proxy answers 503.";
      header_timeout = opt positive "Seconds a client has to send its request head.";
      idle_timeout = opt positive "Seconds after which an idle tunnel is closed.";
      dispatch_socket = opt (types.either (types.strMatching "/.*") (types.enum [ "" ])) ''
        The dispatcher's registration socket. Unset: `/run/agentsandbox/dispatch.sock`.
        `""` never registers (each service binds the port itself).
      '';
      require_session = opt types.bool ''
        Refuse requests that carry no session credential (the SessionStart hook's, or
        `agentsandbox run`'s). Unset: false (requests without one are served, unattributed).
        A user's file may turn it on, never off.
      '';
      dispatch_root = opt types.bool ''
        Whether the dispatcher takes a registration of uid 0, so that root's own service
        serves root's sandboxes through the port. Unset: false (root's registration is
        refused). The dispatcher reads it from this machine's config.
      '';
    };
    inject = opt (types.listOf (table tomlType {
      hosts = mkOption {
        type = types.listOf types.str;
        description = "Plain host names this rule sets the header for (TLS terminated on 443).";
      };
      header = opt types.str "The header to set. Unset: `Authorization`.";
      format = opt types.str "The header value; holds `{token}` or `{basic}`. Unset: `Bearer {token}`.";
      basic_user = opt types.str "The user name `{basic}` encodes with the token.";
      token_command = opt (types.listOf types.str) "A command printing the token (argv).";
      token_file = opt pathStr "A file holding the token.";
      token_env = opt envName "A variable of the service's environment holding the token.";
      renew = opt positive "Seconds between token renewals.";
      token_timeout = opt positive "Seconds the token command may take.";
      requests = opt (types.listOf (requestRule tomlType)) ''
        Ordered request rules (`[[inject.requests]]`): the first whose methods and path match decides.
      '';
      unmatched = opt action "What a request no rule matches gets. Unset: `allow`.";
    })) ''
      Credentials the proxy sets (`[[inject]]`). Unset: the built-in GitHub rule (`gh auth token`).
      `[ ]` injects nothing. Never put a token itself here: the Nix store is world-readable.
    '';
    github = {
      requests = opt (types.listOf (requestRule tomlType)) ''
        Request rules for the built-in GitHub rule (`[[github.requests]]`); only without `inject`.
      '';
      unmatched = opt action "What a GitHub request no rule matches gets. Unset: `allow`.";
      repos = opt (types.listOf (types.strMatching "[A-Za-z0-9-]+/([*]|[A-Za-z0-9._-]+)")) ''
        The repositories (`owner/name`, `owner/*`) the GitHub token may reach; set, it also refuses
        gists, user-level writes and unlisted GraphQL mutations (docs/injection.md).
      '';
      mutations = opt (types.listOf (types.strMatching "[_A-Za-z][_0-9A-Za-z]*")) "GraphQL mutations allowed while `repos` is set.";
    };
    broker = {
      spool = opt pathStr "The spool sessions reach the broker through. Unset: `~/.local/state/agentsandbox/spool`.";
      kubeconfig = opt pathStr "The kubeconfig the `kubeconfig` operation reads.";
      sign = {
        program = opt types.str "The gpg the broker signs with. Unset: git's `gpg.program`, else `gpg`.";
        ssh_key = opt pathStr "The private key for ssh signing (off when unset).";
      };
      run = opt (types.attrsOf (table tomlType {
        argv = mkOption {
          type = types.listOf types.str;
          description = "The program (absolute path) and its fixed arguments.";
        };
        args = opt (types.listOf types.str) "One regular expression per extra argument a session may pass.";
        timeout = opt positive "Seconds the command may run.";
        stream = opt types.bool "Stream output back while the command runs.";
        env = opt (types.listOf envName) "Variables taken from the service's environment.";
        caller_env = opt (types.listOf envName) "Variables taken from the requester's environment (untrusted).";
      })) "Named host commands sessions may ask the broker to run (`[broker.run.NAME]`).";
    };
    scope = {
      slice = opt (types.strMatching "[A-Za-z0-9_.-]+[.]slice") "The systemd slice capped runs go to.";
      memory_max = opt types.str "MemoryMax= of a capped run (bytes, K/M/G/T, or infinity).";
      memory_swap_max = opt types.str "MemorySwapMax= of a capped run.";
      cpu_quota = opt (types.strMatching "[0-9]+%") "CPUQuota= of a capped run, e.g. `200%`.";
      allow_uncapped = opt types.bool "Run a capped command even when its caps do not reach the kernel (a cgroup v1 host, controllers not delegated to the user manager), with a warning; otherwise it is refused.";
    };
    audit = {
      file = opt pathStr "The decision log. Unset: `~/.local/state/agentsandbox/audit.jsonl`.";
      max_bytes = opt types.ints.positive "Size at which the log rotates.";
      keep = opt types.ints.positive "Rotated logs kept.";
      queries = opt types.bool "Whether a terminated request's record keeps its query string. Unset: false.";
    };
    run = {
      env = opt (types.listOf envPattern) "Variables `agentsandbox run` passes to the command.";
    };
  };

  isOption = v: builtins.isAttrs v && (v._type or null) == "option";

  # Nested attrsets of options become submodules with a freeform TOML type.
  toOptions =
    tomlType: prefix: tree:
    lib.mapAttrs (
      name: v:
      if isOption v then
        v
      else
        mkOption {
          type = table tomlType (toOptions tomlType "${prefix}${name}." v);
          default = { };
          description = "The config file's `[${prefix}${name}]` table; keys not listed here pass through as TOML.";
        }
    ) tree;

  # --------------------------------------------------------------- values

  # Null means "not set": drop it everywhere, inside [[inject]] tables too.
  # A table left with nothing in it goes too: the file shows what was set.
  clean =
    v:
    if builtins.isAttrs v then
      lib.filterAttrs (_: x: x != { }) (lib.mapAttrs (_: clean) (lib.filterAttrs (_: x: x != null) v))
    else if builtins.isList v then
      map clean v
    else
      v;

  knownTreeOf = tree: lib.mapAttrs (_: v: if isOption v then null else knownTreeOf v) tree;

  unknownKeys =
    prefix: known: value:
    concatLists (
      lib.mapAttrsToList (
        k: v:
        let
          key = if prefix == "" then k else "${prefix}.${k}";
        in
        if !(known ? ${k}) then
          [ key ]
        else if known.${k} != null && builtins.isAttrs v then
          unknownKeys key known.${k} v
        else
          [ ]
      ) value
    );

  # --------------------------------------------------------------- paths

  # os.path.normpath for absolute paths (and "~"-rooted ones, kept symbolic).
  normpath =
    p:
    let
      root = if hasPrefix "/" p then "/" else "";
      parts = lib.filter (x: x != "" && x != ".") (lib.splitString "/" p);
      step = acc: x: if x == ".." then (if acc == [ ] then [ ] else lib.init acc) else acc ++ [ x ];
    in
    root + lib.concatStringsSep "/" (builtins.foldl' step [ ] parts);

  isAbsolute = v: v == "~" || hasPrefix "~/" v || hasPrefix "/" v;

  # Expand "~" against `home` (a real directory, or "~" to stay symbolic).
  expand = home: v: normpath (if v == "~" then home else if hasPrefix "~/" v then home + lib.removePrefix "~" v else v);

  under =
    path: dir:
    if dir == "/" then hasPrefix "/" path else path == dir || hasPrefix (lib.removeSuffix "/" dir + "/") path;

  repr = s: "'${s}'";

  # --------------------------------------------------------------- allow list

  # Entry.parse and _checkDomains of agentsandbox (egress/rules.py, config.py),
  # for what can be decided without IDNA or an IP library.
  domainErrors =
    proxyPort: i: text:
    let
      key = "sandbox.domains[${toString i}]";
      raw = lib.trim text;
      bracket = builtins.match "[[]([^]]*)[]](.*)" raw;
      colons = builtins.length (lib.splitString ":" raw) - 1;
      split =
        if bracket != null then
          {
            host = builtins.elemAt bracket 0;
            portText =
              let
                rest = builtins.elemAt bracket 1;
              in
              if rest == "" then null else lib.removePrefix ":" rest;
          }
        else if colons > 1 then
          {
            host = raw;
            portText = null;
          }
        else if colons == 1 then
          let
            m = builtins.match "([^:]*):(.*)" raw;
          in
          {
            host = builtins.elemAt m 0;
            portText = builtins.elemAt m 1;
          }
        else
          {
            host = raw;
            portText = null;
          };
      # rules._parsePort: plain digits with no sign and no leading zero, 1 to 65535.
      portOk = t: builtins.match "[1-9][0-9]{0,4}" t != null && builtins.fromJSON t < 65536;
      port = if split.portText == null || !(portOk split.portText) then null else builtins.fromJSON split.portText;
      host = lib.toLower (lib.removeSuffix "." split.host);
      octet = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
      loopbackName =
        h:
        let
          s = lib.removeSuffix "." (lib.toLower (lib.removePrefix "[" (lib.removeSuffix "]" h)));
        in
        s == "localhost"
        || lib.hasSuffix ".localhost" s
        || builtins.match "127[.]${octet}[.]${octet}[.]${octet}" s != null
        || builtins.match "(0*:)+:?0*1" s != null
        || builtins.match "::ffff:127[.]${octet}[.]${octet}[.]${octet}" s != null;
      err = why: [ "${key}: ${why}" ];
    in
    if raw == "" then
      err "an empty entry allows nothing; remove it"
    else if raw == "*" || hasPrefix "*:" raw then
      err "${repr raw} would allow every host; list the hosts instead"
    else if bracket != null && split.portText != null && !(hasPrefix ":" (builtins.elemAt bracket 1)) then
      err "${repr raw}: expected ':port' after ']'"
    else if split.portText != null && !(portOk split.portText) then
      err "${repr raw}: port ${repr split.portText} is not a number from 1 to 65535"
    else if lib.hasInfix "/" split.host then
      [ ] # a CIDR block: the loader's ipaddress decides, at build time
    else if hasPrefix "*." split.host then
      if lib.hasInfix "*" (lib.removePrefix "*." split.host) then
        err "${repr raw}: only one leading '*.' is allowed"
      else if lib.removeSuffix "." (lib.toLower (lib.removePrefix "*." split.host)) == "localhost" && port == null then
        err "${repr raw} would open every loopback port; loopback is reachable only through an explicit IP:port entry such as 127.0.0.1:6443"
      else
        [ ]
    else if lib.hasInfix "*" split.host then
      err "${repr raw}: a wildcard is allowed only as a leading '*.'"
    else if loopbackName host then
      if port == null then
        err "${repr raw} would open every loopback port; loopback is reachable only through an explicit IP:port entry such as 127.0.0.1:6443"
      else if port == proxyPort then
        err "${repr raw} is the egress proxy itself (proxy.port = ${toString proxyPort})"
      else
        [ ]
    else
      [ ];

  # --------------------------------------------------------------- layout

  # Policy.nestedError: a writable path inside a re-allowed readable one.  The
  # readable paths every session gets are added as Policy.fromConfig adds them
  # (with the default CLAUDE_CONFIG_DIR and XDG_CONFIG_HOME).
  nestedErrors =
    home: s:
    let
      ex = expand home;
      sandbox = s.sandbox or { };
      broker = s.broker or { };
      implicitRead = map ex [
        "~/.claude/projects"
        "~/.claude/plans"
        "~/.claude/skills"
        "~/.claude/plugins"
        "~/.claude/CLAUDE.md"
        "~/.gitconfig"
        "~/.config/git"
        "~/.config/agentsandbox"
      ];
      absolute = lib.filter isAbsolute;
      read = lib.unique (lib.sort lib.lessThan (implicitRead ++ map ex (absolute (sandbox.read or [ ]))));
      write = lib.unique (lib.sort lib.lessThan (
        [ (ex (if broker.spool or null == null then "~/.local/state/agentsandbox/spool" else broker.spool)) ]
        ++ map ex (absolute (sandbox.write or [ ]))
      ));
      closed = r: under r (ex "~") || under r "/run/user";
    in
    concatLists (
      map (
        w:
        concatLists (
          map (
            r:
            optional (closed r && w != r && under w r)
              "sandbox.write: the writable path ${w} lies inside the readable path ${r}: the sandbox would mount ${r} read-only over it. List ${w}'s parent in sandbox.write instead, or drop ${r} from sandbox.read"
          ) read
        )
      ) write
    );

  pathErrors =
    s:
    let
      one = key: v: optional (v != null && !(isAbsolute v)) "${key}: ${repr v} is not absolute (write it as ~/… or /…)";
      list = key: vs: concatLists (imap0 (i: one "${key}[${toString i}]") (if vs == null then [ ] else vs));
      sandbox = s.sandbox or { };
      broker = s.broker or { };
    in
    list "sandbox.read" (sandbox.read or null)
    ++ list "sandbox.write" (sandbox.write or null)
    ++ list "sandbox.deny" (sandbox.deny or null)
    ++ one "broker.spool" (broker.spool or null)
    ++ one "broker.kubeconfig" (broker.kubeconfig or null)
    ++ one "broker.sign.ssh_key" ((broker.sign or { }).ssh_key or null)
    ++ one "audit.file" ((s.audit or { }).file or null)
    ++ concatLists (imap0 (i: r: one "inject[${toString i}].token_file" (r.token_file or null)) (s.inject or [ ]));

  injectErrors =
    s:
    concatLists (
      imap0 (
        i: r:
        let
          key = "inject[${toString i}]";
          given = lib.filter (k: (r.${k} or null) != null && r.${k} != "" && r.${k} != [ ]) [
            "token_command"
            "token_file"
            "token_env"
          ];
          fmt = r.format or null;
        in
        optional (r.hosts or [ ] == [ ]) "${key}.hosts: list at least one host"
        ++ optional (builtins.length given != 1) (
          "${key}.token_command: give exactly one of token_command, token_file and token_env"
          + lib.optionalString (given != [ ]) " (found ${lib.concatStringsSep ", " given})"
        )
        ++ optional (fmt != null && !(lib.hasInfix "{token}" fmt) && !(lib.hasInfix "{basic}" fmt)) "${key}.format: must contain {token} or {basic}"
        ++ optional (fmt != null && lib.hasInfix "{basic}" fmt && (r.basic_user or null) == null) "${key}.basic_user: {basic} in format needs basic_user"
      ) (s.inject or [ ])
    );

  runErrors =
    s:
    concatLists (
      lib.mapAttrsToList (
        name: c:
        let
          key = "broker.run.${name}";
        in
        optional (builtins.match "[a-z0-9][a-z0-9._-]*" name == null) "${key}: a command name is lower case letters, digits, '.', '_', '-'"
        ++ optional (c.argv or [ ] == [ ]) "${key}.argv: list the program and its fixed arguments"
        ++ optional (c.argv or [ ] != [ ] && !(isAbsolute (builtins.head c.argv))) "${key}.argv[0]: ${repr (builtins.head c.argv)} must be an absolute path to the program"
      ) ((s.broker or { }).run or { })
    );
in
{
  inherit clean normpath;

  # The settings option, given nixpkgs' TOML format.  `machine = false` (a
  # user's file, home-manager): proxy.port is unset by default, because where
  # /etc/agentsandbox/config.toml exists the port is the machine's alone and a
  # differing one is a notice on every load; the loader's default is 3190.
  option =
    {
      tomlFormat,
      description,
      machine ? true,
    }:
    let
      declared = schema tomlFormat.type;
      userPort = {
        proxy.port = opt (types.ints.between 1 65535) ''
          The loopback port every sandbox dials. Unset: the machine's
          ({file}`/etc/agentsandbox/config.toml`, whose port is the only one used where it
          exists), else 3190.
        '';
      };
    in
    mkOption {
      type = table tomlFormat.type (
        toOptions tomlFormat.type "" (
          if machine then declared else lib.recursiveUpdateUntil (_: old: _: isOption old) declared userPort
        )
      );
      default = { };
      inherit description;
    };

  # Keys of a settings value (cleaned) that no option declares.
  unknownKeys = value: unknownKeys "" (knownTreeOf (schema null)) value;

  # Every refusal Nix can decide, as the loader's "KEY: WHY" texts.  `home` is
  # the user's home directory, or "~" when the file serves every user.
  errors =
    { settings, home }:
    let
      s = clean settings;
      port = (s.proxy or { }).port or 3190;
    in
    pathErrors s
    ++ concatLists (imap0 (domainErrors port) ((s.sandbox or { }).domains or [ ]))
    ++ optionals (pathErrors s == [ ]) (nestedErrors home s)
    ++ injectErrors s
    ++ runErrors s;
}
