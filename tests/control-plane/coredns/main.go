// Command coredns is CoreDNS with only the plugins a local test cluster's DNS needs,
// which keeps its build a fraction of the full one (no cloud providers' SDKs).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// directives are these plugins in the order CoreDNS's plugin.cfg gives them: the order
// in which a query passes through them.
var directives = []string{
	"ready",
	"health",
	"errors",
	"log",
	"loadbalance",
	"cache",
	"kubernetes",
	"forward",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
